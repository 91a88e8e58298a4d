"""A `sluice tune` run: a server, the search within the budget, and what it writes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.bench.settings import BenchSettings, parse_url
from sluice.tune import report, state
from sluice.tune.candidates import Candidate, apply, pbtxt, start_of
from sluice.tune.measure import Measurer, load, model_config
from sluice.tune.search import Axis, Objective, Outcome, Search, best, run_search
from sluice.tune.server import own_serve
from sluice.tune.settings import DEFAULT_DELAYS_US, DEFAULT_INSTANCES, TuneSettings

#: the part of the budget kept for stopping the server and writing the outputs
STOP_RESERVE_S = 5.0
STATE_FILE = "state.jsonl"


@dataclass(frozen=True, slots=True)
class Tuned:
    """What a run found; `pick` is None when no candidate met the objective."""

    outcomes: dict[Candidate, Outcome]
    objective: Objective
    pick: Candidate | None
    #: the model's config as served before tuning (the pick is written over it)
    base_config: dict[str, Any]


def axes_for(settings: TuneSettings, start: Candidate) -> tuple[Axis, ...]:
    """The knobs to turn, each including the model's current value; a model that does not
    batch (max_batch_size 0) can only change its instance count."""

    def ordered(name: str, values: tuple[int, ...], current: int) -> Axis:
        return Axis(name, tuple(sorted({*values, current})), ordered=True)

    instances = ordered("instances", settings.instances or DEFAULT_INSTANCES, start.instances)
    if not start.max_batch_size:
        return (instances,)
    top = start.max_batch_size
    sizes = settings.max_batch_sizes or tuple(2**i for i in range(top.bit_length()) if 2**i <= top)
    return (
        ordered("max_batch_size", sizes, top),
        ordered("delay_us", settings.delays_us or DEFAULT_DELAYS_US, start.delay_us),
        instances,
        Axis("batch_delay", ("fixed", "adaptive"), ordered=False),
        Axis("preferred", ("none", "max"), ordered=False),
    )


def state_key(settings: TuneSettings, base_config: dict[str, Any]) -> str:
    """What earlier measurements must share with this run to be reused."""
    where = str(settings.model_repository.resolve()) if settings.model_repository else settings.url
    return state.fingerprint(
        {
            "where": where,
            "model": settings.model,
            "p99_ms": settings.p99_ms,
            "workers": settings.workers,
            "max_concurrency": settings.max_concurrency,
            "window_ms": settings.window_ms,
            "max_trials": settings.max_trials,
            "warmup_s": settings.warmup_s,
            "base_config": base_config,
        }
    )


@contextlib.contextmanager
def _server(settings: TuneSettings) -> Iterator[str]:
    if settings.url is not None:
        yield settings.url
        return
    assert settings.model_repository is not None  # the settings require one or the other
    log_path = settings.out_dir / "serve.log"
    with own_serve(settings.model_repository, settings.model, settings.workers, log_path) as url:
        yield url


async def _search(
    settings: TuneSettings,
    url: str,
    clock: Callable[[], float],
    deadline: float,
    on_progress: Callable[[Candidate], None],
) -> Tuned:
    host, port = parse_url(url)
    bench_settings = BenchSettings(
        url=f"{host}:{port}",
        model=settings.model,
        window_ms=settings.window_ms,
        max_trials=settings.max_trials,
        warmup_s=settings.warmup_s,
    )
    target = bench_settings.target
    base_config = await model_config(target)
    objective = Objective(settings.p99_ms, settings.min_throughput)
    start = start_of(base_config)
    key = state_key(settings, base_config)
    path = settings.out_dir / STATE_FILE
    search = Search(start, axes_for(settings, start), objective, state.load(path, key, objective))

    def on_outcome(candidate: Candidate, outcome: Outcome) -> None:
        state.append(path, key, candidate, outcome)

    measure = Measurer(
        bench_settings, base_config, objective, settings.max_concurrency, clock, on_progress
    )
    try:
        await run_search(search, measure, clock, deadline, on_outcome)
    finally:
        if settings.url is not None:  # a running fleet gets its own config back
            await load(target, base_config)
    top = best(search.outcomes, objective)
    pick = top if top is not None and search.outcomes[top].meets(objective) else None
    return Tuned(search.outcomes, objective, pick, base_config)


def tune(
    settings: TuneSettings,
    on_progress: Callable[[Candidate], None],
    clock: Callable[[], float] = time.monotonic,
) -> Tuned:
    """Start (or reach) the server and search until done or out of budget."""
    deadline = clock() + settings.budget_s - min(STOP_RESERVE_S, settings.budget_s / 10)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    with _server(settings) as url:
        return asyncio.run(_search(settings, url, clock, deadline, on_progress))


def write_outputs(settings: TuneSettings, tuned: Tuned) -> list[Path]:
    """table.txt, pareto.png (with matplotlib) and the pick's config.pbtxt; the paths written."""
    out = settings.out_dir
    text = report.table(
        tuned.outcomes, tuned.objective, tuned.pick, settings.price_per_hour, settings.workers
    )
    (out / "table.txt").write_text(text + "\n")
    written = [out / "table.txt"]
    if report.write_plot(tuned.outcomes, tuned.objective, tuned.pick, out / "pareto.png"):
        written.append(out / "pareto.png")
    if tuned.pick is not None:
        (out / "config.pbtxt").write_text(pbtxt(apply(tuned.base_config, tuned.pick)))
        written.append(out / "config.pbtxt")
    return written
