"""`sluice serve`: Redis (embedded unless given), N workers, bulk-job rq workers and a gateway.

Workers run as child processes that die with this one; a worker that exits unexpectedly is
started again. SIGINT/SIGTERM stop the gateway (in-flight requests answered), then the
workers (batches in hand finished), then the embedded Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import uvloop

from gateway.server import GatewayConfig, serve_gateway
from shared.redis_client import split_cluster_flag
from sluice.embedded_redis import EmbeddedRedis, die_with_parent

log = logging.getLogger("sluice.serve")

SLUICE = (sys.executable, "-m", "sluice")
RESTART_DELAY_S = 1.0
WORKER_STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model_repository: Path
    gateway: GatewayConfig
    workers: int = 1
    embedded_redis: bool = False
    #: extra `sluice worker` options (recovery settings) passed to every worker.
    worker_args: tuple[str, ...] = ()
    #: rq workers running bulk jobs (`sluice jobs worker`).
    bulk_workers: int = 1
    #: the log level of every process serve starts.
    log_level: str = "info"


def worker_argv(repository: Path, redis_url: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        *SLUICE,
        "worker",
        "--model-repository",
        str(repository),
        "--redis-url",
        redis_url,
        *extra,
    ]


def bulk_worker_argv(redis_url: str, log_level: str) -> list[str]:
    return [*SLUICE, "jobs", "worker", "--redis-url", redis_url, "--log-level", log_level]


class WorkerPool:
    """Keeps `count` processes of one command alive until stopped."""

    def __init__(self, count: int, argv: list[str]) -> None:
        self.count = count
        self.argv = argv
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._keep(slot)) for slot in range(self.count)]

    async def _keep(self, slot: int) -> None:
        while not self.stopping:
            process = await asyncio.create_subprocess_exec(*self.argv, preexec_fn=die_with_parent)
            self.processes[slot] = process
            code = await process.wait()
            if self.stopping:
                return
            log.warning(
                "%s %d (pid %d) exited with %s; restarting", self.argv[3], slot, process.pid, code
            )
            await asyncio.sleep(RESTART_DELAY_S)

    async def stop(self) -> None:
        self.stopping = True
        for process in self.processes.values():
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                await asyncio.wait_for(process.wait(), WORKER_STOP_TIMEOUT_S)
            except TimeoutError:
                process.kill()
                await process.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _serve(config: ServeConfig) -> None:
    redis_url = config.gateway.redis_url
    pools = [
        WorkerPool(
            config.workers,
            worker_argv(
                config.model_repository,
                redis_url,
                (*config.worker_args, "--log-level", config.log_level),
            ),
        ),
    ]
    if split_cluster_flag(redis_url)[1]:
        log.warning("bulk jobs are off: rq needs a Redis that is not a cluster")
    else:
        pools.append(WorkerPool(config.bulk_workers, bulk_worker_argv(redis_url, config.log_level)))
    for pool in pools:
        pool.start()
    host, port = config.gateway.host, config.gateway.http_port

    def announce() -> None:
        log.info(
            "sluice ready: http://%s:%d (metrics on :%d)", host, port, config.gateway.metrics_port
        )

    try:
        await serve_gateway(config.gateway, on_ready=announce)
    finally:
        await asyncio.gather(*(pool.stop() for pool in pools))


def run_serve(config: ServeConfig) -> None:
    with contextlib.ExitStack() as stack:
        if config.embedded_redis:
            redis_server = stack.enter_context(EmbeddedRedis())
            log.info("embedded Redis at %s", redis_server.url)
            gateway = dataclasses.replace(config.gateway, redis_url=redis_server.url)
            config = dataclasses.replace(config, gateway=gateway)
        uvloop.run(_serve(config))
