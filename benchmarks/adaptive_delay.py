"""Triton's fixed batching delay, with and without early runs, against the adaptive one.

Each round serves the reference MLP (max_batch_size 64, delay 1000 µs, torch 1 thread) three
ways, in an order rotated each round: `fixed` (the model parameter `BATCH_DELAY` = `fixed`:
every partial batch waits out the delay, as Triton's does) with `--no-early-run`; the same with
early runs (the default: while requests come far apart, the lone batch the delay will release
runs as the delay runs out and answers only once that batch is formed); and `adaptive` (opt-in:
no wait while requests arrive further apart than the delay). Each is driven by `sluice bench`:
closed loop at concurrency 1, then open-loop Poisson arrivals at each rate. It prints, per
load, the medians over the rounds of p50 / p99, the server's queue time and the average batch,
and each variant's p50 over that of Triton's plain wait.

    python benchmarks/adaptive_delay.py [--rates 100,400,1000,2000] [--rounds 3]
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

#: label -> (the model's BATCH_DELAY, sluice serve's options)
VARIANTS = {
    "fixed": ("fixed", ("--no-early-run",)),
    "fixed+early": ("fixed", ("--early-run",)),
    "adaptive": ("adaptive", ("--no-early-run",)),
}
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
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loads: list[tuple[Mode, float]] = [("concurrency", 1)]
    loads += [("request_rate", float(r)) for r in args.rates.split(",")]
    figures: dict[tuple[str, int], list[Figures]] = defaultdict(list)
    labels = list(VARIANTS)
    for round_ in range(args.rounds):
        turn = labels[round_ % len(labels) :] + labels[: round_ % len(labels)]
        for slot, label in enumerate(turn):
            mode, options = VARIANTS[label]
            port = PORT + 10 * (round_ * len(labels) + slot)
            with serving(repository(mode), port, options) as (url, _):
                for index, (kind, level) in enumerate(loads):
                    figures[(label, index)].append(measure(url, kind, level))
                    p50, p99, queue, batch = figures[(label, index)][-1]
                    print(
                        f"[{label}] {kind} {level:g}: p50 {p50:.2f} ms p99 {p99:.2f} ms "
                        f"queue {queue:.2f} ms batch {batch:.2f}",
                        flush=True,
                    )
    head = " | ".join(f"{v} p50 / p99 ms | {v} queue ms | {v} batch" for v in labels)
    ratios = " | ".join(f"{label} / fixed p50" for label in labels[1:])
    print(f"\n| load | {head} | {ratios} |")
    print("|---|" + "---|" * (3 * len(labels) + len(labels) - 1))
    for index, (kind, level) in enumerate(loads):
        medians = {
            label: [statistics.median(c) for c in zip(*figures[(label, index)], strict=True)]
            for label in labels
        }
        cells = " | ".join(
            f"{m[0]:.2f} / {m[1]:.1f} | {m[2]:.2f} | {m[3]:.2f}" for m in medians.values()
        )
        fixed = medians["fixed"][0]
        shares = " | ".join(f"{medians[label][0] / fixed:.2f}" for label in labels[1:])
        name = "c=1 (closed loop)" if kind == "concurrency" else f"{level:g}/s Poisson"
        print(f"| {name} | {cells} | {shares} |")


if __name__ == "__main__":
    main()
