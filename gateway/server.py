"""Runs a gateway: the HTTP API and the metrics port, on uvicorn with httptools and uvloop.

Why this stack: uvicorn's httptools parser and uvloop are C; a bare ASGI callable adds no
routing or middleware layers on the hot path.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn
from redis.exceptions import RedisError

from gateway.app import GatewayApp, GatewayLimits
from gateway.dispatcher import Dispatcher
from gateway.metrics import MetricsApp
from gateway.model_table import ModelTable
from shared.redis_client import async_client

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    redis_url: str
    host: str = "127.0.0.1"
    http_port: int = 8000
    metrics_port: int = 8002
    limits: GatewayLimits = field(default_factory=GatewayLimits)
    #: seconds to answer in-flight requests after a stop signal.
    graceful_shutdown_s: float = 30.0


def _uvicorn(app: object, host: str, port: int, graceful_s: float) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="none",
        http="httptools",
        lifespan="off",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=graceful_s,
        backlog=4096,
    )
    return uvicorn.Server(config)


async def serve_gateway(
    config: GatewayConfig,
    *,
    on_ready: Callable[[], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (or `stop` is set), then answer in-flight requests and exit."""
    gateway_id = f"gw-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    redis = async_client(config.redis_url)
    reader = async_client(config.redis_url, socket_timeout_s=None)
    dispatcher = Dispatcher(redis, reader, gateway_id)
    table = ModelTable(redis, gateway_id, dispatcher.inflight_snapshot)
    http = _uvicorn(
        GatewayApp(dispatcher, table, config.limits),
        config.host,
        config.http_port,
        config.graceful_shutdown_s,
    )
    metrics = _uvicorn(MetricsApp(redis, table), config.host, config.metrics_port, 1.0)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    background = [
        asyncio.create_task(dispatcher.read_replies(), name="replies"),
        asyncio.create_task(table.run(), name="model-table"),
    ]
    servers = [asyncio.create_task(_run(s)) for s in (http, metrics)]
    watcher = asyncio.create_task(_announce_ready(table, http, on_ready)) if on_ready else None
    try:
        done, _ = await asyncio.wait(
            [*servers, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED
        )
        for task in done:
            if task in servers:
                task.result()  # raises if a port could not be bound
                raise RuntimeError("HTTP server stopped unexpectedly")
    finally:
        log.info("gateway stopping: answering in-flight requests")
        for server in (http, metrics):
            server.should_exit = True
        await asyncio.gather(*servers, return_exceptions=True)
        for task in [*background, *([watcher] if watcher else [])]:
            task.cancel()
        await dispatcher.close()
        await table.remove_self()
        await redis.aclose()
        await reader.aclose()


async def _run(server: uvicorn.Server) -> None:
    """uvicorn exits the process when it cannot bind; turn that into an error we can clean up."""
    try:
        await server._serve()
    except SystemExit:
        config = server.config
        raise RuntimeError(f"cannot serve on {config.host}:{config.port}") from None


async def _announce_ready(
    table: ModelTable, http: uvicorn.Server, on_ready: Callable[[], None]
) -> None:
    while not (http.started and table.ready):
        table.refreshed.clear()
        try:
            await asyncio.wait_for(table.refreshed.wait(), timeout=1.0)
        except TimeoutError:
            pass
        except RedisError:
            pass
    on_ready()
