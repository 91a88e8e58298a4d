"""The load loop: closed-loop workers or an open-loop schedule, measured in windows.

The load runs without pause across a level's windows; each window only swaps the recorder
the requests report to and reads the server's statistics, as perf_analyzer does.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from sluice.bench.http import Connection, ProtocolError, encode_get, get_json
from sluice.bench.payload import InputSpec, encode_infer, input_specs, make_array
from sluice.bench.server_stats import ServerTotals, fetch_totals
from sluice.bench.settings import BenchSettings, Target
from sluice.bench.stats import STABLE_WINDOWS, Measurement, WindowSample, is_stable, measure

#: an open-loop schedule waits for a free connection beyond this many in flight
MAX_OPEN_LOOP_CONNECTIONS = 1024
#: errors a dropped connection surfaces as; the request counts as failed, the run goes on
CONNECTION_ERRORS = (ConnectionError, asyncio.IncompleteReadError, ProtocolError)

OnWindow = Callable[[float, int, Measurement], None]


class BenchError(Exception):
    """The run cannot go on (model unknown, server unreachable, bad option for the model)."""


@dataclass(slots=True)
class Recorder:
    latencies_ns: list[int] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)


class Load:
    """What the load tasks and the window loop share."""

    def __init__(self) -> None:
        self.running = True
        self.recorder = Recorder()

    def swap(self) -> Recorder:
        """Start a new window; return what the last one recorded."""
        done, self.recorder = self.recorder, Recorder()
        return done


@dataclass(frozen=True, slots=True)
class LevelResult:
    level: float
    stable: bool
    trials: list[Measurement]
    #: the last windows merged (the stable ones when `stable`)
    result: Measurement


@dataclass(frozen=True, slots=True)
class BenchResult:
    settings: BenchSettings
    inputs: list[InputSpec]
    levels: list[LevelResult]


def error_kind(status: int, body: bytes) -> str:
    """`HTTP 503: <the server's message>`, short enough to count by."""
    try:
        message = orjson.loads(body).get("error", "")
    except (orjson.JSONDecodeError, AttributeError):
        message = body[:120].decode(errors="replace")
    return f"HTTP {status}: {str(message)[:120]}"


async def _send(conn: Connection, request: bytes, load: Load) -> None:
    start_ns = time.perf_counter_ns()
    try:
        status, body = await conn.exchange(request)
    except CONNECTION_ERRORS as exc:
        conn.close()
        load.recorder.errors[f"connection: {type(exc).__name__}"] += 1
        return
    latency_ns = time.perf_counter_ns() - start_ns
    if status == 200:
        load.recorder.latencies_ns.append(latency_ns)
    else:
        load.recorder.errors[error_kind(status, body)] += 1


async def _closed_loop(conn: Connection, request: bytes, load: Load) -> None:
    """One worker: the next request as soon as the last answered (a failed reconnect ends it)."""
    try:
        while load.running:
            if conn.closed:
                await conn.open()
            await _send(conn, request, load)
    finally:
        conn.close()


async def _release_after(
    conn: Connection, request: bytes, load: Load, idle: asyncio.Queue[Connection]
) -> None:
    await _send(conn, request, load)
    idle.put_nowait(conn)


async def _open_loop(
    target: Target, request: bytes, rate: float, poisson: bool, load: Load
) -> None:
    """Send at `rate` req/s whatever the answers, each request on a free connection."""
    rng = random.Random(0)  # the same schedule on every run
    loop = asyncio.get_running_loop()
    idle: asyncio.Queue[Connection] = asyncio.Queue()
    connections: list[Connection] = []
    in_flight: set[asyncio.Task[None]] = set()
    due_s = loop.time()
    try:
        while load.running:
            due_s += rng.expovariate(rate) if poisson else 1 / rate
            delay_s = due_s - loop.time()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            if idle.empty() and len(connections) < MAX_OPEN_LOOP_CONNECTIONS:
                connections.append(await Connection(target.host, target.port).open())
                conn = connections[-1]
            else:
                conn = await idle.get()
            if conn.closed:
                await conn.open()
            task = asyncio.create_task(_release_after(conn, request, load, idle))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        await asyncio.gather(*in_flight)
    finally:
        for conn in connections:
            conn.close()


async def _wait(tasks: list[asyncio.Task[None]], duration_s: float) -> None:
    """Let the load run; a load task that failed (server gone) ends the run."""
    done, _ = await asyncio.wait(tasks, timeout=duration_s, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        task.result()


class _Probe:
    """Reads the server's statistics between windows on a connection of its own."""

    def __init__(self, conn: Connection, target: Target) -> None:
        self.conn = conn
        self.model = target.model
        self.request = encode_get(
            target.authority, f"/v2/models/{target.model}/stats", target.auth_token
        )

    async def totals(self) -> ServerTotals | None:
        if self.conn.closed:
            await self.conn.open()
        return await fetch_totals(self.conn, self.request, self.model)


async def _measure_level(
    level: float,
    tasks: list[asyncio.Task[None]],
    load: Load,
    probe: _Probe,
    settings: BenchSettings,
    on_window: OnWindow,
) -> LevelResult:
    await _wait(tasks, settings.warmup_s)
    before = await probe.totals()
    load.swap()
    start_s, cpu_s = time.perf_counter(), time.process_time()
    samples: list[WindowSample] = []
    trials: list[Measurement] = []
    while len(trials) < settings.max_trials and not is_stable(trials, settings.stability_percent):
        await _wait(tasks, settings.window_s)
        recorder = load.swap()
        end_s, cpu_end_s = time.perf_counter(), time.process_time()
        after = await probe.totals()
        server = after - before if after is not None and before is not None else None
        samples.append(
            WindowSample(
                end_s - start_s, cpu_end_s - cpu_s, recorder.latencies_ns, recorder.errors, server
            )
        )
        trials.append(measure(samples[-1:], settings.batch_size))
        on_window(level, len(trials), trials[-1])
        before, start_s, cpu_s = after, end_s, cpu_end_s
    stable = is_stable(trials, settings.stability_percent)
    return LevelResult(
        level, stable, trials, measure(samples[-STABLE_WINDOWS:], settings.batch_size)
    )


async def _run_level(
    level: float, request: bytes, probe: _Probe, settings: BenchSettings, on_window: OnWindow
) -> LevelResult:
    load = Load()
    target = settings.target
    if settings.mode == "concurrency":
        conns = [Connection(target.host, target.port) for _ in range(int(level))]
        try:
            await asyncio.gather(*(c.open() for c in conns))
        except OSError:
            for conn in conns:
                conn.close()
            raise
        tasks = [asyncio.create_task(_closed_loop(c, request, load)) for c in conns]
    else:
        poisson = settings.distribution == "poisson"
        tasks = [asyncio.create_task(_open_loop(target, request, level, poisson, load))]
    try:
        return await _measure_level(level, tasks, load, probe, settings, on_window)
    finally:
        load.running = False
        await asyncio.gather(*tasks, return_exceptions=True)


async def _get(conn: Connection, target: Target, path: str) -> dict[str, Any]:
    status, body = await get_json(conn, encode_get(target.authority, path, target.auth_token))
    if status != 200 or not isinstance(body, dict):
        detail = body.get("error", body) if isinstance(body, dict) else body
        raise BenchError(f"GET {path}: HTTP {status}: {detail}")
    return body


async def _request_bytes(
    conn: Connection, settings: BenchSettings
) -> tuple[bytes, list[InputSpec]]:
    target = settings.target
    metadata = await _get(conn, target, f"/v2/models/{target.model}")
    config = await _get(conn, target, f"/v2/models/{target.model}/config")
    try:
        specs = input_specs(metadata, config, settings.batch_size)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    rng = np.random.default_rng(0)
    arrays = [make_array(s, settings.input_data, rng) for s in specs]
    request = encode_infer(
        target.authority,
        target.model,
        specs,
        arrays,
        binary=settings.binary,
        auth_token=target.auth_token,
    )
    return request, specs


async def bench(settings: BenchSettings, on_window: OnWindow) -> BenchResult:
    """Every load level in turn, each measured until stable or out of trials."""
    target = settings.target
    try:
        conn = await Connection(target.host, target.port).open()
    except OSError as exc:
        raise BenchError(f"cannot connect to {target.authority}: {exc}") from None
    try:
        request, specs = await _request_bytes(conn, settings)
        probe = _Probe(conn, target)
        levels = [
            await _run_level(level, request, probe, settings, on_window)
            for level in settings.levels
        ]
    except (OSError, *CONNECTION_ERRORS) as exc:
        raise BenchError(f"{target.authority}: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    return BenchResult(settings, specs, levels)


def run_bench(settings: BenchSettings, on_window: OnWindow) -> BenchResult:
    """`bench` on uvloop when it is installed (a cheaper client), else on asyncio's loop."""
    runner: Callable[[Awaitable[BenchResult]], BenchResult]
    try:
        import uvloop

        runner = uvloop.run  # type: ignore[assignment]
    except ImportError:
        runner = asyncio.run  # type: ignore[assignment]
    return runner(bench(settings, on_window))
