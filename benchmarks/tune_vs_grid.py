"""`sluice tune` against a grid search by hand over the same knobs, on the same server.

For each model: one `sluice serve` (explicit model control, one worker), then `sluice tune`'s
search against it (--url mode, its time budget), then a hand grid (every combination of two
values per knob, a person's first sweep), each candidate ramped by the same measurer (sluice
bench at 1, 2, 4, ... connections until the p99 passes the objective). Finally both picks are
measured again back to back, alternating, so that the side-by-side figures share the machine's
state. It prints both picks, how many candidates and seconds each search spent, and each pick's
throughput at the objective in that last measurement (the median of the rounds).

    python benchmarks/tune_vs_grid.py [--budget-s 150] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sluice.bench.settings import BenchSettings  # noqa: E402
from sluice.tune.candidates import Candidate, start_of  # noqa: E402
from sluice.tune.measure import Measurer, load, model_config  # noqa: E402
from sluice.tune.run import tune  # noqa: E402
from sluice.tune.search import Objective, Outcome, best  # noqa: E402
from sluice.tune.server import own_serve  # noqa: E402
from sluice.tune.settings import TuneSettings  # noqa: E402

REPOSITORY = ROOT / "examples" / "model_repository"
#: model -> (p99 objective in ms, the hand grid's two values per knob)
CASES = {
    "mlp": (25.0, {"max_batch_size": (8, 64), "delay_us": (100, 1000)}),
    "digits": (10.0, {"max_batch_size": (8, 32), "delay_us": (100, 1000)}),
}
GRID_COMMON = {"instances": (1, 2), "batch_delay": ("fixed", "adaptive")}
MAX_CONCURRENCY = 32
WINDOW_MS, MAX_TRIALS, WARMUP_S = 500, 3, 0.3


def _quiet(candidate: Candidate) -> None:
    """No progress output: the script prints its figures at the end."""


def grid(start: Candidate, knobs: dict[str, tuple[object, ...]]) -> list[Candidate]:
    axes = {**knobs, **GRID_COMMON}
    out = []
    for values in itertools.product(*axes.values()):
        out.append(dataclasses.replace(start, **dict(zip(axes, values, strict=True))))
    return out


async def _grid_search(measurer: Measurer, candidates: list[Candidate]) -> dict[Candidate, Outcome]:
    outcomes = {}
    for candidate in candidates:
        outcome = await measurer(candidate, float("inf"))
        assert outcome is not None
        outcomes[candidate] = outcome
    return outcomes


async def _remeasure(
    measurer: Measurer, picks: dict[str, Candidate], objective: Objective, rounds: int
) -> dict[str, float]:
    """Throughput at the objective of each pick, median of `rounds` alternating ramps."""
    seen: dict[str, list[float]] = {name: [] for name in picks}
    for _ in range(rounds):
        for name, candidate in picks.items():
            outcome = await measurer(candidate, float("inf"))
            assert outcome is not None
            level = outcome.at_objective(objective)
            seen[name].append(level.throughput if level else 0.0)
            ramp = ", ".join(
                f"c{lv.concurrency} {lv.throughput:.0f}/s p99 {lv.p99_ms:.1f} ms"
                + (f" {lv.errors} errors" if lv.errors else "")
                for lv in outcome.levels
            )
            print(f"  again {name}: {ramp}", file=sys.stderr, flush=True)
    return {name: statistics.median(values) for name, values in seen.items()}


def run_case(model: str, budget_s: float, rounds: int, scratch: Path) -> str:
    p99_ms, knobs = CASES[model]
    objective = Objective(p99_ms)
    with own_serve(REPOSITORY, model, 1, scratch / f"{model}-serve.log") as url:
        began = time.monotonic()
        settings = TuneSettings(
            model=model,
            p99_ms=p99_ms,
            url=url,
            budget_s=budget_s,
            max_concurrency=MAX_CONCURRENCY,
            window_ms=WINDOW_MS,
            max_trials=MAX_TRIALS,
            warmup_s=WARMUP_S,
            out_dir=scratch / model,
        )
        tuned = tune(settings, _quiet)
        tune_s = time.monotonic() - began
        bench = BenchSettings(
            url=url, model=model, window_ms=WINDOW_MS, max_trials=MAX_TRIALS, warmup_s=WARMUP_S
        )

        async def compare() -> tuple[dict[Candidate, Outcome], float, dict[str, float], Candidate]:
            base = await model_config(bench.target)
            measurer = Measurer(bench, base, objective, MAX_CONCURRENCY, time.monotonic, _quiet)
            began = time.monotonic()
            outcomes = await _grid_search(measurer, grid(start_of(base), knobs))
            grid_s = time.monotonic() - began
            grid_pick = best(outcomes, objective)
            print(
                f"{model}: tune picked {tuned.pick.label() if tuned.pick else None}, "
                f"grid picked {grid_pick.label() if grid_pick else None}",
                file=sys.stderr,
                flush=True,
            )
            assert grid_pick is not None and tuned.pick is not None
            again = await _remeasure(
                measurer, {"tune": tuned.pick, "grid": grid_pick}, objective, rounds
            )
            await load(bench.target, base)
            return outcomes, grid_s, again, grid_pick

        outcomes, grid_s, again, grid_pick = asyncio.run(compare())
    assert tuned.pick is not None
    ratio = (
        f"  tune / grid: {again['tune'] / again['grid']:.2f}"
        if again["grid"]
        else "  the grid's pick met the objective in no round measured again"
    )
    return (
        f"{model} (p99 <= {p99_ms:g} ms)\n"
        f"  tune: {len(tuned.outcomes):>2} candidates, {tune_s:>5.0f} s  pick "
        f"{tuned.pick.label()}: {again['tune']:.0f} infer/s\n"
        f"  grid: {len(outcomes):>2} candidates, {grid_s:>5.0f} s  pick "
        f"{grid_pick.label()}: {again['grid']:.0f} infer/s\n{ratio}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default=",".join(CASES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        lines = []
        for model in args.models.split(","):
            lines.append(run_case(model, args.budget_s, args.rounds, Path(scratch)))
            print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
