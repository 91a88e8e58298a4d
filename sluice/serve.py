"""`sluice serve`: Redis (embedded unless given), N workers, bulk-job rq workers and gateways.

Workers run as child processes that die with this one; a worker that exits unexpectedly is
started again. SIGINT/SIGTERM stop the gateway (in-flight requests answered), then the
workers (batches in hand finished), then the embedded Redis, all within --drain-timeout-s:
requests still in flight then get a 503, and children still draining get SIGKILL. Each child
is a plain `sluice worker` (or `sluice jobs worker`) that reads the settings serve hands it
as JSON in one environment variable. With --gateways N, N - 1 `sluice gateway` children run
beside serve's own gateway, all on the same ports (SO_REUSEPORT: the kernel spreads connections
over them), so that the gateways' Python work uses N cores; `sluice gateway --gateways N`
(`run_gateways`) does the same for a gateway alone (the gateway image).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import orjson
import uvloop

from sluice import runtime_file
from sluice.embedded_redis import EmbeddedRedis, default_maxmemory, tied_to_parent
from sluice.gateway.server import GatewayConfig, serve_gateway
from sluice.options import Settings
from sluice.settings import (
    GATEWAY_SETTINGS_ENV,
    JOBS_WORKER_SETTINGS_ENV,
    WORKER_SETTINGS_ENV,
    GatewaySettings,
    ServeSettings,
)
from sluice.shared.drain_deadline import DrainDeadline, on_stop_signals
from sluice.shared.redis_client import split_cluster_flag
from sluice.shared.registry import Member

log = logging.getLogger("sluice.serve")

# -P: the working directory does not lead sys.path, so a checkout's sluice/ folder (which lacks the
# gateway, shared and workers that an install maps in) cannot shadow the installed package
SLUICE = (sys.executable, "-P", "-m", "sluice")
RESTART_DELAY_S = 1.0
#: children still running this long after the drain timeout get SIGKILL; serve itself exits
#: (killing what is left) this long again later, whatever it waits on.
KILL_MARGIN_S = 1.0


WORKER_ARGV = [*SLUICE, "worker"]
GATEWAY_ARGV = [*SLUICE, "gateway"]
JOBS_WORKER_ARGV = [*SLUICE, "jobs", "worker"]


def handed_down(variable: str, settings: Settings) -> dict[str, str]:
    """The environment of a child that reads `settings` from `variable`."""
    return {**os.environ, variable: orjson.dumps(settings.to_json_dict()).decode()}


class WorkerPool:
    """Keeps `count` processes of one command alive until stopped.

    Each runs in a session of its own, so that a Ctrl-C in a terminal reaches serve alone and
    the processes stop in serve's order (gateway first) rather than all at once.
    """

    def __init__(self, count: int, argv: list[str], env: dict[str, str]) -> None:
        self.count = count
        self.argv = argv
        #: for the log: `worker`, `jobs worker`
        self.name = " ".join(argv[len(SLUICE) :])
        self.env = env
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.stopping = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._keep(slot)) for slot in range(self.count)]

    async def _keep(self, slot: int) -> None:
        while not self.stopping:
            process = await asyncio.create_subprocess_exec(
                *tied_to_parent(self.argv), env=self.env, start_new_session=True
            )
            self.processes[slot] = process
            code = await process.wait()
            if self.stopping:
                return
            log.warning(
                "%s %d (pid %d) exited with %s; restarting", self.name, slot, process.pid, code
            )
            await asyncio.sleep(RESTART_DELAY_S)

    def up(self, members: Sequence[Member]) -> bool:
        """Every process of the pool has started and heartbeats (a worker does once it has
        loaded its models)."""
        here = socket.gethostname()
        beating = {m.pid for m in members if m.host == here}
        running = self.running()
        return len(running) == self.count and beating.issuperset(running)

    def running(self) -> list[int]:
        return [p.pid for p in list(self.processes.values()) if p.returncode is None]

    async def stop(self, kill_at_s: float) -> None:
        """SIGTERM every process (each drains within its own --drain-timeout-s); SIGKILL those
        still running at `kill_at_s` (event-loop time)."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        for process in self.processes.values():
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                await asyncio.wait_for(process.wait(), max(0.0, kill_at_s - loop.time()))
            except TimeoutError:
                log.warning("%s (pid %d) still draining: SIGKILL", self.name, process.pid)
                process.kill()
                await process.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.kill()  # one started while stopping

    def kill(self) -> None:
        """SIGKILL whatever still runs; safe from any thread."""
        for pid in self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def _serve(settings: ServeSettings, gateway: GatewayConfig) -> None:
    redis_url = gateway.redis_url
    drain_s = settings.drain_timeout_s
    workers = handed_down(WORKER_SETTINGS_ENV, settings.worker_settings(redis_url))
    pools = [WorkerPool(settings.workers, WORKER_ARGV, workers)]
    if split_cluster_flag(redis_url)[1]:
        log.warning("bulk jobs are off: rq needs a Redis that is not a cluster")
    else:
        jobs = handed_down(JOBS_WORKER_SETTINGS_ENV, settings.jobs_worker_settings(redis_url))
        pools.append(WorkerPool(settings.bulk_workers, JOBS_WORKER_ARGV, jobs))
    # the gateways beside serve's own, on its ports (SO_REUSEPORT)
    others = handed_down(GATEWAY_SETTINGS_ENV, settings.gateway_settings(redis_url))
    gateways = WorkerPool(settings.gateway_count() - 1, GATEWAY_ARGV, others)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_at_s: list[float] = []

    def kill_children() -> None:
        gateways.kill()
        for pool in pools:
            pool.kill()
        runtime_file.remove()

    deadline = DrainDeadline(
        drain_s + 2 * KILL_MARGIN_S,
        "sluice serve",
        lambda: ", ".join(f"{p.name} pid {pid}" for p in (gateways, *pools) for pid in p.running()),
        kill_children,
    )

    def on_stop() -> None:
        stop_at_s.append(loop.time())
        stop.set()

    on_stop_signals(deadline, loop, on_stop)
    for pool in pools:
        pool.start()
    host, port = gateway.host, gateway.http_port

    def announce() -> None:
        grpc = gateway.grpc.port
        on = f"gRPC on :{grpc}, " if grpc else ""
        log.info(
            "sluice ready: http://%s:%d (%smetrics on :%d)", host, port, on, gateway.metrics_port
        )

    def all_up(members: Sequence[Member]) -> bool:
        return pools[0].up(members) and gateways.up(members)

    try:
        gateways.start()
        await serve_gateway(gateway, on_ready=announce, stop=stop, workers_up=all_up)
    finally:
        kill_at_s = (stop_at_s[0] if stop_at_s else loop.time()) + drain_s + KILL_MARGIN_S
        await gateways.stop(kill_at_s)  # the gateways first: workers answer what they queued
        await asyncio.gather(*(pool.stop(kill_at_s) for pool in pools))


def _announce_locally(gateway: GatewayConfig, repository: Path) -> None:
    """The runtime file through which `sluice status` and `sluice jobs` find this serve."""
    host = gateway.host
    record = runtime_file.ServeRecord(
        os.getpid(),
        gateway.redis_url,
        f"{host}:{gateway.http_port}",
        f"{host}:{gateway.metrics_port}",
        time.time(),
        str(repository.resolve()),
    )
    try:
        runtime_file.write(record)
    except OSError as exc:
        log.warning("sluice status will need --redis-url: no runtime file (%s)", exc)


def run_serve(settings: ServeSettings) -> None:
    with contextlib.ExitStack() as stack:
        redis_url = settings.redis_url
        if redis_url is None:
            maxmemory = settings.redis_maxmemory
            if maxmemory is None:
                maxmemory = default_maxmemory()
            redis_url = stack.enter_context(EmbeddedRedis(maxmemory=maxmemory)).url
            log.info("embedded Redis at %s, maxmemory %d MiB", redis_url, maxmemory >> 20)
        gateway = settings.gateway_config(redis_url)
        if settings.gateway_count() > 1:
            gateway = dataclasses.replace(gateway, share_ports=True)
        stack.callback(runtime_file.remove)
        _announce_locally(gateway, settings.model_repository)
        uvloop.run(_serve(settings, gateway))


def run_gateways(settings: GatewaySettings) -> None:
    """`sluice gateway --gateways N`: this gateway and N - 1 children on the same ports."""
    uvloop.run(_gateways(settings))


async def _gateways(settings: GatewaySettings) -> None:
    drain_s = settings.drain_timeout_s
    children = handed_down(GATEWAY_SETTINGS_ENV, settings.child_settings())
    pool = WorkerPool(settings.gateway_count() - 1, GATEWAY_ARGV, children)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_at_s: list[float] = []
    deadline = DrainDeadline(
        drain_s + 2 * KILL_MARGIN_S,
        "sluice gateway",
        lambda: ", ".join(f"gateway pid {pid}" for pid in pool.running()),
        pool.kill,
    )

    def on_stop() -> None:
        stop_at_s.append(loop.time())
        stop.set()

    def announce() -> None:
        log.info(
            "sluice ready: http://%s:%d, %d gateways",
            settings.host,
            settings.http_port,
            pool.count + 1,
        )

    on_stop_signals(deadline, loop, on_stop)
    config = dataclasses.replace(settings.config(), share_ports=True)
    pool.start()
    try:
        await serve_gateway(config, on_ready=announce, stop=stop, workers_up=pool.up)
    finally:
        kill_at_s = (stop_at_s[0] if stop_at_s else loop.time()) + drain_s + KILL_MARGIN_S
        await pool.stop(kill_at_s)
