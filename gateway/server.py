"""Runs a gateway: the HTTP API and the metrics port, on shared/http_server.py and uvloop, and
the gRPC API (gateway/grpc_server.py) on the same event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from sluice.gateway.app import GatewayApp
from sluice.gateway.background import start_background
from sluice.gateway.bearer import BearerGuard
from sluice.gateway.bulk_api import BulkApi
from sluice.gateway.core import GatewayCore, GatewayLimits
from sluice.gateway.dispatcher import Dispatcher
from sluice.gateway.grpc_options import GrpcOptions
from sluice.gateway.job_operations import JobOperations
from sluice.gateway.job_watch import JobWatch
from sluice.gateway.jobs import JobStore
from sluice.gateway.metrics import MetricsApp
from sluice.gateway.model_table import ModelTable, no_versions
from sluice.gateway.outage import OutagePolicy
from sluice.gateway.response_cache.cache_config import CacheConfig
from sluice.gateway.response_cache.cache_stats import CacheStats
from sluice.gateway.response_cache.local_store import LocalStore
from sluice.gateway.response_cache.redis_store import RedisStore
from sluice.gateway.response_cache.response_cache import ResponseCache
from sluice.gateway.stream_window import StreamLoad
from sluice.gateway.trace_file import TraceFile
from sluice.gateway.trace_spans import GatewaySpans
from sluice.gateway.tracing import FleetTracing
from sluice.shared.drain_deadline import DrainDeadline, on_stop_signals
from sluice.shared.errors import Unavailable
from sluice.shared.gc_tuning import settle_after_startup
from sluice.shared.http_server import HttpServer
from sluice.shared.otel import exporting
from sluice.shared.redis_client import REDIS_ERRORS, async_client, initialized
from sluice.shared.registry import Member
from sluice.shared.supervision import Supervisor
from sluice.shared.tasks import stop_tasks
from sluice.shared.trace_settings import TraceSettings

if TYPE_CHECKING:
    from sluice.gateway.grpc_h2.port import H2GrpcPort
    from sluice.gateway.grpc_server import GrpcPort

log = logging.getLogger(__name__)

#: of the drain timeout, at most this goes to writing the errors of requests still in flight
#: at its end, and as much again to leaving Redis.
ANSWER_S = 1.0
#: how often readiness is checked again while no model-table refresh comes.
READY_RECHECK_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    """Built from the settings (sluice.settings), which hold every option's default: each
    field named as its option is that option's value."""

    redis_url: str
    host: str
    http_port: int
    metrics_port: int
    #: the gRPC port (0: no gRPC) and its limits.
    grpc: GrpcOptions
    limits: GatewayLimits
    #: seconds to answer in-flight requests after a stop signal; those still waiting then get
    #: a 503, and a gateway on its own exits by this deadline.
    drain_timeout_s: float
    #: microseconds to keep polling with one request in flight (0: sleep at once).
    idle_poll_us: int
    #: how long, and how much, to hold requests while Redis is unreachable.
    outage: OutagePolicy
    #: bytes of a streamed request's responses held for a client that does not read them.
    stream_max_held_bytes: int
    #: Triton's response cache (--cache-config); None: no cache.
    cache_config: CacheConfig | None = None
    #: bind the ports with SO_REUSEPORT: other gateways of this host take connections on them.
    share_ports: bool = False
    #: Triton's trace settings from --trace-config.
    trace_config: TraceSettings = field(default_factory=TraceSettings)


def _tracing(config: GatewayConfig, redis: aioredis.Redis) -> FleetTracing:
    """The trace file is the one --trace-config names; each of several gateway processes on
    the same ports (serve --gateways) writes its own, the process id added to its name. In
    OpenTelemetry mode, spans go to its exporter instead."""
    settings = config.trace_config
    if settings.opentelemetry:
        return FleetTracing(redis, settings, None, GatewaySpans(exporting(settings, "gateway")))
    path = settings.file
    if path and config.share_ports:
        path = f"{path}.{os.getpid()}"
    return FleetTracing(redis, config.trace_config, TraceFile(path) if path else None)


async def serve_gateway(
    config: GatewayConfig,
    *,
    on_ready: Callable[[], None] | None = None,
    stop: asyncio.Event | None = None,
    workers_up: Callable[[Sequence[Member]], bool] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (or, when given, until `stop` is set: then the caller
    handles signals and bounds the whole drain), then answer in-flight requests and exit.
    `on_ready` is called once the fleet serves, and `workers_up` (given the fleet's live
    members) says so too: serve's own workers have loaded their models."""
    gateway_id = f"gw-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    redis = async_client(config.redis_url)
    reader = async_client(config.redis_url, socket_timeout_s=None)
    dispatcher = Dispatcher(
        redis,
        reader,
        gateway_id,
        config.idle_poll_us,
        config.outage,
        stream_max_held_bytes=config.stream_max_held_bytes,
    )
    supervisor = Supervisor()
    table = ModelTable(
        redis,
        gateway_id,
        dispatcher.inflight_snapshot,
        control_mode=config.limits.model_control_mode,
        on_unloaded=lambda model: dispatcher.abandon(model, no_versions(model)),
        on_depths=dispatcher.dealer.observe,
        background_up=lambda: supervisor.up,
    )
    waiter = async_client(config.redis_url, socket_timeout_s=None)
    for client in (redis, reader, waiter):  # before the tasks and requests share them
        await initialized(client)
    limits = config.limits
    watch = JobWatch(waiter)
    jobs = JobStore(redis, watch, limits.job_ttl_s, limits.max_jobs)
    bulk = BulkApi(config.redis_url, limits.max_body_bytes, limits.max_bulk_jobs)
    cache, cache_redis = _response_cache(config, redis, table)
    tracing = _tracing(config, redis)
    core = GatewayCore(dispatcher, table, config.limits, bulk, cache, tracing)
    app = GatewayApp(core, JobOperations(core, jobs), config.limits)
    http = HttpServer(app, config.limits.max_body_bytes, app.precheck)
    streams = StreamLoad()
    metrics_app = MetricsApp(redis, table, streams, cache)
    metrics = _metrics_port(metrics_app, config.limits.metrics_auth_token)
    stop = stop or _stop_on_signal(config.drain_timeout_s, http)
    start_background(dispatcher, table, supervisor)
    supervisor.start("job-events", watch.run)
    supervisor.start("log-settings", partial(core.logging.control.follow, redis))
    supervisor.start("trace-settings", tracing.follow)
    if cache is not None:
        supervisor.start("cache-statistics", cache.stats.run)
    background: list[asyncio.Task[None]] = []
    grpc_port = _grpc_port(core, config, streams)
    settle_after_startup()
    try:
        await http.start(config.host, config.http_port, config.share_ports)
        await metrics.start(config.host, config.metrics_port, config.share_ports)
        if grpc_port is not None:
            await grpc_port.start()
        if on_ready is not None:
            announce = _announce_ready(table, on_ready, workers_up or (lambda _: True))
            background.append(asyncio.create_task(announce))
        await stop.wait()
    finally:
        log.info("gateway stopping: answering in-flight requests")
        answer_s = min(ANSWER_S, config.drain_timeout_s / 4)
        wait_s = config.drain_timeout_s - 2 * answer_s
        error = Unavailable(
            f"gateway shutting down: no answer within its drain timeout "
            f"({config.drain_timeout_s:g} s); retry"
        )
        await asyncio.gather(
            http.shutdown(wait_s, lambda: dispatcher.replies.fail_waiting(error), answer_s),
            metrics.shutdown(wait_s),
            # past the wait, requests still waiting get `error` (above): time to write it
            grpc_port.stop(wait_s + answer_s) if grpc_port is not None else asyncio.sleep(0),
        )
        await stop_tasks(background)
        await supervisor.stop()
        tracing.close()
        await dispatcher.close()
        bulk.close()
        await table.remove_self()
        await redis.aclose()
        await reader.aclose()
        await waiter.aclose()
        if cache_redis is not None:
            await cache_redis.aclose()


def _response_cache(
    config: GatewayConfig, redis: aioredis.Redis, table: ModelTable
) -> tuple[ResponseCache | None, aioredis.Redis | None]:
    """The gateway's response cache, and the Redis client of its own it opened, if any."""
    settings = config.cache_config
    if settings is None:
        return None, None
    stats = CacheStats(redis)
    if settings.cache == "local":
        return ResponseCache(LocalStore(settings.local_size), stats, table.config_of), None
    url = settings.redis_url(config.redis_url)
    own = async_client(url) if url != config.redis_url else None
    store = RedisStore(own or redis, settings.ttl_s, settings.max_entry_bytes)
    return ResponseCache(store, stats, table.config_of), own


def _grpc_port(
    core: GatewayCore, config: GatewayConfig, streams: StreamLoad
) -> GrpcPort | H2GrpcPort | None:
    """The gRPC port, not listening yet, or None when gRPC is off. Its modules load only
    then: a gateway without gRPC needs neither grpcio nor tritonclient's messages."""
    if config.grpc.port == 0:
        return None
    args = (core, config.grpc, config.host, config.limits, streams, config.share_ports)
    if config.grpc.server == "grpcio":
        from sluice.gateway.grpc_server import GrpcPort

        return GrpcPort(*args)
    from sluice.gateway.grpc_h2.port import H2GrpcPort

    return H2GrpcPort(*args)


def _metrics_port(app: MetricsApp, token: str | None) -> HttpServer:
    """The metrics port: open, as Triton's is (Prometheus scrapes it), unless
    --metrics-auth-token asks scrapers for a token."""
    if token is None:
        return HttpServer(app)
    guard = BearerGuard(app, token)
    return HttpServer(guard, precheck=guard.precheck)


def _stop_on_signal(drain_timeout_s: float, http: HttpServer) -> asyncio.Event:
    """Set by SIGINT/SIGTERM, which also start the drain's hard deadline (a second one exits
    at once): a gateway on its own exits within `drain_timeout_s` whatever it waits on."""
    stop = asyncio.Event()
    deadline = DrainDeadline(
        drain_timeout_s, "gateway", lambda: f"{http.busy} requests in flight" if http.busy else ""
    )

    on_stop_signals(deadline, asyncio.get_running_loop(), stop.set)
    return stop


async def _announce_ready(
    table: ModelTable,
    on_ready: Callable[[], None],
    workers_up: Callable[[Sequence[Member]], bool],
) -> None:
    """Ready once the table is and the workers are: on a Redis that other fleets share, the
    table may be ready with their models before this fleet's workers have loaded theirs."""
    while not (table.ready and workers_up(table.members)):
        table.refreshed.clear()
        with contextlib.suppress(TimeoutError, *REDIS_ERRORS):
            await asyncio.wait_for(table.refreshed.wait(), timeout=READY_RECHECK_S)
    on_ready()
