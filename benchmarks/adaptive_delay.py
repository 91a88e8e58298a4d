"""sluice's adaptive batching delay against Triton's fixed one, side by side in one run.

Each round serves the reference MLP (max_batch_size 64, delay 1000 µs, torch 1 thread) twice,
once with the model parameter `BATCH_DELAY` = `fixed` (every partial batch waits out the
delay, as Triton's does; the default) and once `adaptive` (opt-in: no wait while requests
arrive further apart than the delay), in alternating order, and drives each with
`sluice bench`: closed loop at concurrency 1, then open-loop Poisson arrivals at each rate.
It prints, per load, the medians over the rounds of p50 / p99, the server's queue time and
the average batch, and the adaptive / fixed p50 ratio.

    python benchmarks/adaptive_delay.py [--rates 100,400,1000,2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from compare_triton import mlp_repository, serving  # noqa: E402

from sluice.bench.loadgen import run_bench  # noqa: E402
from sluice.bench.settings import BenchSettings, Mode  # noqa: E402

MODES = ("fixed", "adaptive")
PORT = 18800
#: (p50 ms, p99 ms, server queue ms, average batch) of one load on one server
Figures = tuple[float, float, float, float]


def repository(mode: str) -> Path:
    """The example MLP with `BATCH_DELAY` set to `mode`."""
    parameter = f'parameters: {{ key: "BATCH_DELAY" value: {{ string_value: "{mode}" }} }}'
    return mlp_repository(lambda config: f"{config}\n{parameter}\n")


def measure(url: str, mode: Mode, level: float) -> Figures:
    """One level; `mode` names the option the level is given to (concurrency, request_rate)."""
    levels = {mode: (level,)}
    settings = BenchSettings(url=url, model="mlp", distribution="poisson", max_trials=6, **levels)
    result = run_bench(settings, lambda *_: None).levels[0].result
    if result.latency is None or result.server is None:
        raise RuntimeError(f"{mode} {level}: no answers ({result.error_kinds})")
    latency, server = result.latency, result.server
    return latency.p50_us / 1e3, latency.p99_us / 1e3, server.queue_us / 1e3, server.avg_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="100,400,1000,2000")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    loads: list[tuple[Mode, float]] = [("concurrency", 1)]
    loads += [("request_rate", float(r)) for r in args.rates.split(",")]
    figures: dict[tuple[str, int], list[Figures]] = defaultdict(list)
    for round_ in range(args.rounds):
        for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
            with serving(repository(mode), PORT + 10 * round_) as (url, _):
                for index, (kind, level) in enumerate(loads):
                    figures[(mode, index)].append(measure(url, kind, level))
                    p50, p99, queue, batch = figures[(mode, index)][-1]
                    print(
                        f"[{mode}] {kind} {level:g}: p50 {p50:.2f} ms p99 {p99:.2f} ms "
                        f"queue {queue:.2f} ms batch {batch:.2f}",
                        flush=True,
                    )
    print(
        "\n| load | fixed p50 / p99 ms | adaptive p50 / p99 ms | fixed queue ms | "
        "adaptive queue ms | fixed batch | adaptive batch | adaptive / fixed p50 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for index, (kind, level) in enumerate(loads):
        fixed, adaptive = (
            [statistics.median(column) for column in zip(*figures[(m, index)], strict=True)]
            for m in MODES
        )
        label = "c=1 (closed loop)" if kind == "concurrency" else f"{level:g}/s Poisson"
        print(
            f"| {label} | {fixed[0]:.2f} / {fixed[1]:.1f} | {adaptive[0]:.2f} / "
            f"{adaptive[1]:.1f} | {fixed[2]:.2f} | {adaptive[2]:.2f} | {fixed[3]:.2f} | "
            f"{adaptive[3]:.2f} | {adaptive[0] / fixed[0]:.2f} |"
        )


if __name__ == "__main__":
    main()
