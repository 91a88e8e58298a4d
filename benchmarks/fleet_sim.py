"""A sluice fleet of 1 to 1,000 workers, simulated: where Redis saturates, what shards buy,
and what one shared queue per model does to batching and latency (the model and its
assumptions: `benchmarks/fleet_model.py`).

    python benchmarks/fleet_sim.py [--calibration benchmarks/out/scale_workers.json] \
        [--plot benchmarks/fleet_sim.png] [--json benchmarks/out/fleet_sim.json]

With --partitions-sweep, instead: one hot model's stream split into partitions over 1-32
Redis Cluster shards, 16-1,000 workers, what it sustains before its busiest shard is one core.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from fleet_model import (
    DEFAULT_LOADS,
    DEFAULT_WORKERS,
    FLAT_SERVICE_MS,
    FLEET_SIZES,
    PLOT_LOADS,
    POLICIES,
    REDIS_POLICIES,
    SHARDS,
    Batching,
    RedisCost,
    Service,
    SimResult,
    calibration,
    redis_cores,
    run_grid,
    simulate,
    worker_limit,
)
from fleet_partitions import SWEEP_READS, PartitionResult, hot_model, sweep_clusters


def latency_table(rows: Sequence[SimResult]) -> str:
    lines = [
        "| workers | load | shared: batch, p50 / p99 ms | pull (sluice): batch, p50 / p99 ms "
        "| round-robin: batch, p50 / p99 ms |",
        "|---|---|---|---|---|",
    ]
    by = {(r.workers, r.load, r.policy): r for r in rows}
    for w, load in sorted({(r.workers, r.load) for r in rows}):
        cells = [
            f"{r.mean_batch:.1f}, {r.p50_ms:.1f} / {r.p99_ms:.1f}"
            for r in (by[(w, load, p)] for p in POLICIES)
        ]
        lines.append(f"| {w} | {load:.0%} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _count(workers: float) -> str:
    return f"{workers:.1f}" if workers < 10 else f"{workers:,.0f}"


def redis_table(cost: RedisCost, batches: dict[str, float], worker_rate: float) -> str:
    lines = [
        "| mean batch | Redis µs/inference | one shard saturates at infer/s "
        "| = workers at 80 % load |",
        "|---|---|---|---|",
    ]
    for label, b in batches.items():
        rate = cost.shard_rate(b)
        lines.append(
            f"| {label} | {cost.us_per_inference(b):.1f} | {rate:,.0f} | "
            f"{_count(rate / worker_rate)} |"
        )
    return "\n".join(lines)


def shard_table(cost: RedisCost, batches: dict[str, float], worker_rate: float) -> str:
    """Workers K shards carry, for each policy's mean batch: many models, then one hot one."""
    names = list(batches)
    lines = [
        "| shards | "
        + " | ".join(f"{p} (batch {b:.1f}): spread / one hot model" for p, b in batches.items())
        + " |",
        "|---|" + "---|" * len(names),
    ]
    for k in SHARDS:
        cells = [
            f"{_count(worker_limit(cost, b, worker_rate, k, hot_model=False))} / "
            f"{_count(worker_limit(cost, b, worker_rate, k, hot_model=True))}"
            for b in batches.values()
        ]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fleet_batches(
    per_worker: int, seed: int, batching: Batching, service: Service
) -> dict[str, list[float]]:
    """Mean executed batch at 80 % load per fleet size, for the policies that go through Redis
    (round-robin is Triton behind a load balancer: no Redis)."""
    out: dict[str, list[float]] = {p: [] for p in REDIS_POLICIES}
    for w in FLEET_SIZES:
        requests = max(20_000, per_worker * w)
        for p in REDIS_POLICIES:
            out[p].append(simulate(p, w, 0.8, requests, seed, batching, service).mean_batch)
    return out


def fleet_table(fleet: dict[str, list[float]], cost: RedisCost, worker_rate: float) -> str:
    lines = [
        "| workers | infer/s at 80 % load | "
        + " | ".join(f"{p}: batch, Redis cores" for p in fleet)
        + " |",
        "|---|---|" + "---|" * len(fleet),
    ]
    for i, w in enumerate(FLEET_SIZES):
        rate = 0.8 * w * worker_rate
        cells = [f"{b[i]:.1f}, {redis_cores(rate, b[i], cost):.2f}" for b in fleet.values()]
        lines.append(f"| {w} | {rate:,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def partition_table(rows: Sequence[PartitionResult], worker_rate: float) -> str:
    """Each cluster against one shard at the same fleet size; workers at the limit are those
    the sustained rate keeps at the offered load."""
    one = {r.workers: r.infer_s for r in rows if r.shards == 1}
    lines = [
        "| shards | partitions | each worker reads | workers | sustained infer/s | x one shard "
        "| workers at the limit | batch | partitions per batch | Redis µs/inference "
        "| busiest / mean shard | p99 ms (workers) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        limit = _count(r.infer_s / (r.load * worker_rate)) if r.redis_bound else "-"
        reads = r.reads or "all"
        lines.append(
            f"| {r.shards} | {r.partitions} | {reads} | {r.workers:,} | {r.infer_s:,.0f}"
            f"{'' if r.redis_bound else ' (workers)'} | {r.infer_s / one[r.workers]:.2f} "
            f"| {limit} | {r.mean_batch:.1f} | {r.batch_partitions:.2f} "
            f"| {r.redis_us_per_inference:.1f} | {r.imbalance:.3f} | {r.p99_ms:.1f} |"
        )
    return "\n".join(lines)


def run_partitions_sweep(
    args: argparse.Namespace, batching: Batching, service: Service, cost: RedisCost
) -> None:
    worker_rate = service.capacity(batching.max_batch)
    n, seed = args.requests_per_worker, args.seed
    rows = [hot_model(c, args.load, n, seed, batching, service, cost) for c in sweep_clusters()]
    print(
        f"\none hot model at {args.load:.0%} load ({args.load * worker_rate:,.0f} infer/s per "
        f"worker offered), partition p on shard p mod shards; sustained: the offered rate, or "
        f"the rate at which the busiest shard reaches one core at these batch sizes; each worker "
        f"reads all partitions, or {SWEEP_READS} of them:"
    )
    print(partition_table(rows, worker_rate))
    if args.json:
        write_json(
            args.json,
            {
                "service": asdict(service),
                "redis_cost": asdict(cost),
                "batching": asdict(batching),
                "partitions": [asdict(r) for r in rows],
            },
        )


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))


def _latency_panel(axis: Any, curve: Sequence[SimResult], title: str) -> None:
    """p99 against load: a colour per policy, a line style per fleet size."""
    sizes = sorted({r.workers for r in curve})
    for colour, policy in enumerate(POLICIES):
        for w, style in zip(sizes, ("-", "--"), strict=False):
            points = sorted(
                (r.load, r.p99_ms) for r in curve if (r.policy, r.workers) == (policy, w)
            )
            axis.plot(
                *zip(*points, strict=True),
                style,
                color=f"C{colour}",
                marker="o",
                label=f"{policy}, {w} workers",
            )
    axis.set(xlabel="load (of full-batch capacity)", ylabel="p99 latency (ms)")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=7)


def _redis_panel(
    axis: Any, fleet: dict[str, list[float]], cost: RedisCost, worker_rate: float
) -> None:
    """Redis cores the fleet needs; K shards give K cores only if its models spread."""
    sizes = np.array(FLEET_SIZES, dtype=float)
    for policy, batches in fleet.items():
        cores = [
            redis_cores(0.8 * w * worker_rate, b, cost) for w, b in zip(sizes, batches, strict=True)
        ]
        axis.plot(sizes, cores, marker="o", label=f"{policy} (its mean batch)")
    hot = 1 / cost.model_slot_share
    marks = ((1, "1 shard"), (hot, "one hot model, any K"), (4, "4 shards"), (16, "16 shards"))
    for level, text in marks:
        axis.axhline(level, color="grey", linestyle=":", linewidth=1)
        axis.text(sizes[-1], level * 1.06, text, fontsize=7, ha="right")
    axis.set(xlabel="workers at 80 % load", ylabel="Redis CPU (cores)", xscale="log", yscale="log")
    axis.set_title("Redis CPU needed vs fleet size; K shards carry K cores", fontsize=9)
    axis.legend(fontsize=7, loc="upper left")


def write_plot(
    path: Path,
    curves: dict[str, list[SimResult]],
    fleet: dict[str, list[float]],
    cost: RedisCost,
    worker_rate: float,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves) + 1, figsize=(16, 4.8))
    for axis, (title, curve) in zip(axes, curves.items(), strict=False):
        _latency_panel(axis, curve, title)
    _redis_panel(axes[-1], fleet, cost, worker_rate)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibration", type=Path, help="scale_workers.py --json output")
    parser.add_argument("--workers", default=",".join(map(str, DEFAULT_WORKERS)))
    parser.add_argument("--loads", default=",".join(map(str, DEFAULT_LOADS)))
    parser.add_argument("--requests-per-worker", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--plot", type=Path, default=Path(__file__).with_name("fleet_sim.png"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--partitions-sweep",
        action="store_true",
        help="only the partition sweep: one hot model over 1-32 shards, 16-1,000 workers",
    )
    parser.add_argument("--load", type=float, default=0.8, help="the partition sweep's load")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    started_s = time.monotonic()
    service, cost = calibration(args.calibration)
    flat = Service(FLAT_SERVICE_MS[0] / 1e3, FLAT_SERVICE_MS[1] / 1e3)
    batching = Batching()
    worker_rate = service.capacity(batching.max_batch)
    print(
        f"measured t(b) = {service.a_s * 1e3:.2f} ms + {service.c_s * 1e3:.3f} ms x b "
        f"(one worker: {worker_rate:,.0f} infer/s at batch {batching.max_batch}); "
        f"Redis {cost.us_per_batch:.0f} µs/batch + {cost.us_per_request:.1f} µs/request, "
        f"model-slot share {cost.model_slot_share:.0%}, read and ack {cost.read_share:.0%} "
        "of a batch's"
    )
    if args.partitions_sweep:
        run_partitions_sweep(args, batching, service, cost)
        print(f"\ntook {time.monotonic() - started_s:.0f} s")
        return
    workers = [int(w) for w in args.workers.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    n, seed = args.requests_per_worker, args.seed
    grids = {
        "measured": run_grid(workers, loads, n, seed, batching, service),
        "flat": run_grid(workers, loads, n, seed, batching, flat),
    }
    print("\nmeasured t(b):\n" + latency_table(grids["measured"]))
    print(f"\nflat t(b) = {FLAT_SERVICE_MS[0]} ms + {FLAT_SERVICE_MS[1]} ms x b (not measured):")
    print(latency_table(grids["flat"]))
    plot_workers = [w for w in (16, 64) if w in workers] or workers[:1]
    curves = {
        f"p99 vs load, measured t(b) = {service.a_s * 1e3:.2f} + {service.c_s * 1e3:.3f}·b ms": (
            run_grid(plot_workers, PLOT_LOADS, n, seed, batching, service)
        ),
        f"p99 vs load, flat t(b) = {FLAT_SERVICE_MS[0]} + {FLAT_SERVICE_MS[1]}·b ms": (
            run_grid(plot_workers, PLOT_LOADS, n, seed, batching, flat)
        ),
    }
    fleet = fleet_batches(1000, seed, batching, service)
    at_64 = {p: b[FLEET_SIZES.index(64)] for p, b in fleet.items()}
    print("\n" + redis_table(cost, {"1": 1.0, "8": 8.0, "64": 64.0}, 0.8 * worker_rate))
    print("\nmean batch and Redis cores at 80 % load (measured t(b)):")
    print(fleet_table(fleet, cost, worker_rate))
    print("\nworkers at 80 % load before the busiest shard reaches one core (batch at 64 workers):")
    print(shard_table(cost, at_64, 0.8 * worker_rate))
    write_plot(args.plot, curves, fleet, cost, worker_rate)
    print(f"\nwrote {args.plot}; took {time.monotonic() - started_s:.0f} s")
    if args.json:
        write_json(
            args.json,
            {
                "service": asdict(service),
                "flat_service": asdict(flat),
                "redis_cost": asdict(cost),
                "grids": {k: [asdict(r) for r in v] for k, v in grids.items()},
                "curves": {k: [asdict(r) for r in v] for k, v in curves.items()},
                "fleet_sizes": list(FLEET_SIZES),
                "fleet_mean_batch": fleet,
            },
        )


if __name__ == "__main__":
    main()
