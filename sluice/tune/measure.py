"""Measuring one candidate: load it live through repository control, then ramp concurrency
with sluice's own load generator until the p99 passes the objective or throughput stops
growing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import orjson

from sluice.bench.http import Connection, encode_request, get_json
from sluice.bench.loadgen import bench
from sluice.bench.settings import BenchSettings, Target
from sluice.bench.stats import Measurement
from sluice.tune.candidates import Candidate, apply
from sluice.tune.search import Level, Objective, Outcome

#: a level that adds less than this share of throughput to the last one: the server is
#: saturated and more concurrency would only add latency
SATURATED = 0.05
#: this many such levels in a row end the ramp (one may be noise)
SATURATED_LEVELS = 2


class TuneError(Exception):
    """The server refused what tune asked (a config it cannot load, a model it does not know)."""


async def _call(target: Target, method: str, path: str, body: bytes = b"") -> Any:
    conn = await Connection(target.host, target.port).open()
    try:
        headers = {"Content-Type": "application/json"} if body else {}
        request = encode_request(method, target.authority, path, body, headers, target.auth_token)
        status, answer = await get_json(conn, request)
    finally:
        conn.close()
    if status != 200:
        detail = answer.get("error", answer) if isinstance(answer, dict) else answer
        raise TuneError(f"{method} {path}: HTTP {status}: {detail}")
    return answer


async def model_config(target: Target) -> dict[str, Any]:
    """The model's config as it is served now (Triton's JSON)."""
    config: dict[str, Any] = await _call(target, "GET", f"/v2/models/{target.model}/config")
    return config


async def load(target: Target, config: dict[str, Any]) -> None:
    """Reload the model fleet-wide with `config`; returns once it is ready again."""
    body = orjson.dumps({"parameters": {"config": orjson.dumps(config).decode()}})
    await _call(target, "POST", f"/v2/repository/models/{target.model}/load", body)


def ramp(max_concurrency: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to and including `max_concurrency`."""
    levels = [1]
    while levels[-1] * 2 < max_concurrency:
        levels.append(levels[-1] * 2)
    return (*levels, max_concurrency) if max_concurrency > 1 else (1,)


class Measurer:
    """Measures candidates on one server, each within the run's deadline."""

    def __init__(
        self,
        bench_settings: BenchSettings,
        base_config: dict[str, Any],
        objective: Objective,
        max_concurrency: int,
        clock: Callable[[], float],
        on_window: Callable[[Candidate], None],
    ) -> None:
        self.settings = bench_settings
        self.base_config = base_config
        self.objective = objective
        self.levels = ramp(max_concurrency)
        self.clock = clock
        self.on_window = on_window
        #: how long a level is expected to take, until one has been measured
        self.level_s = bench_settings.warmup_s + 3 * bench_settings.window_s

    async def __call__(self, candidate: Candidate, deadline: float) -> Outcome | None:
        began = self.clock()
        await load(self.settings.target, apply(self.base_config, candidate))
        levels: list[Level] = []
        flat = 0  # levels in a row that added too little to the best throughput before them
        for concurrency in self.levels:
            if self.clock() + self.level_s > deadline:
                break
            level_began = self.clock()
            level = await self._level(candidate, concurrency)
            self.level_s = self.clock() - level_began
            top = max((lv.throughput for lv in levels), default=0.0)
            levels.append(level)
            if level.errors or level.p99_ms > self.objective.p99_ms:
                break
            flat = flat + 1 if level.throughput < top * (1 + SATURATED) else 0
            if flat == SATURATED_LEVELS:
                break
        if not levels:
            return None
        return Outcome(tuple(levels), self.clock() - began)

    async def _level(self, candidate: Candidate, concurrency: int) -> Level:
        settings = dataclasses.replace(self.settings, concurrency=(concurrency,))

        def window(level: float, trial: int, measurement: Measurement) -> None:
            self.on_window(candidate)

        result = (await bench(settings, window)).levels[0].result
        p99_ms = result.latency.p99_us / 1e3 if result.latency else float("inf")
        return Level(concurrency, result.throughput, p99_ms, result.errors)
