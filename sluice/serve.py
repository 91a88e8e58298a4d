"""`sluice serve`: Redis (embedded unless given), N worker processes and a gateway, as one unit.

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
from sluice.embedded_redis import EmbeddedRedis, die_with_parent

log = logging.getLogger("sluice.serve")

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


class WorkerPool:
    """Keeps `count` worker processes alive until stopped."""

    def __init__(
        self, count: int, repository: Path, redis_url: str, extra: tuple[str, ...] = ()
    ) -> None:
        self.count = count
        self.argv = [
            sys.executable,
            "-m",
            "sluice",
            "worker",
            "--model-repository",
            str(repository),
            "--redis-url",
            redis_url,
            *extra,
        ]
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
            log.warning("worker %d (pid %d) exited with %s; restarting", slot, process.pid, code)
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
    pool = WorkerPool(
        config.workers, config.model_repository, config.gateway.redis_url, config.worker_args
    )
    pool.start()
    host, port = config.gateway.host, config.gateway.http_port

    def announce() -> None:
        log.info(
            "sluice ready: http://%s:%d (metrics on :%d)", host, port, config.gateway.metrics_port
        )

    try:
        await serve_gateway(config.gateway, on_ready=announce)
    finally:
        await pool.stop()


def run_serve(config: ServeConfig) -> None:
    with contextlib.ExitStack() as stack:
        if config.embedded_redis:
            redis_server = stack.enter_context(EmbeddedRedis())
            log.info("embedded Redis at %s", redis_server.url)
            gateway = dataclasses.replace(config.gateway, redis_url=redis_server.url)
            config = dataclasses.replace(config, gateway=gateway)
        uvloop.run(_serve(config))
