"""A sluice fleet of 1 to 1,000 workers, simulated: where Redis saturates, what shards buy,
and what one shared queue per model does to batching and latency.

Discrete-event simulation, seeded, calibrated with figures measured by
`benchmarks/scale_workers.py` (its JSON with `--calibration`, else the defaults below):

* a worker runs one batch at a time; a batch of b takes t(b) = a + c·b (fitted to the
  reference MLP alone, 1 torch thread);
* requests arrive as one Poisson stream, scaled to the fleet: load = rate / (workers x
  max_batch / t(max_batch)), i.e. against what the fleet does at full batches;
* the batcher is Triton's: run when max_batch requests wait or when the oldest has waited
  the delay (64 and 1 ms, as the reference model);
* Redis costs CPU per executed batch (a fixed set of commands: reads, one reply XADD, one
  ack-and-statistics script; the gateway's entries and reply reads, which also thin out
  under load, are folded in) plus a little per request (its tensors in and out), so the
  per-inference cost falls with batch size; a shard saturates when rate x cost reaches one
  core. Redis is not otherwise simulated: no queueing delay in it before it saturates.

Three ways to get requests to workers, at the same arrival stream:

* shared: one work-conserving queue per model and one batcher; whichever worker has a free
  instance runs the next batch (the ideal a stream with a consumer group aims at);
* pull: what sluice's workers do: each worker with a free instance keeps one blocking
  XREADGROUP open; Redis hands each new entry to the longest-waiting reader, which batches
  what it holds by the same rule; entries that find no reader wait in the stream and the
  next worker to free up takes up to max_batch of them at once;
* round_robin: each server its own dynamic batcher, requests dealt in turn (Triton behind
  a round-robin load balancer).

Not modelled: network time, the gateway, the gateway grouping requests that arrive together
into one stream entry (one request per entry here), uneven hash-slot spread, and failures.

    python benchmarks/fleet_sim.py [--calibration benchmarks/out/scale_workers.json] \
        [--plot benchmarks/fleet_sim.png] [--json benchmarks/out/fleet_sim.json]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: Measured on 2026-11-29 (x86_64, 2 cores, other work running) by
#: `python benchmarks/scale_workers.py`: the MLP alone, 1 thread (397, 1,049, 2,731 and 3,215
#: infer/s at batch 1, 8, 32, 64), fitted to t(b) = a + c·b ...
SERVICE_A_MS = 2.484
SERVICE_C_MS = 0.298
#: ... Redis CPU per executed batch and per request (loopback TCP, idle background out) ...
REDIS_US_PER_BATCH = 588.8
REDIS_US_PER_REQUEST = 11.3
#: ... and the share of Redis command time on the model's own keys (its Cluster slot).
MODEL_SLOT_SHARE = 0.732

DEFAULT_WORKERS = (4, 16, 64)
DEFAULT_LOADS = (0.5, 0.8, 0.95)
PLOT_LOADS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
FLEET_SIZES = (1, 4, 16, 64, 256, 1000)
SHARDS = (1, 2, 4, 8, 16)
#: not measured: a GPU-like curve where batching is nearly free (t(64) = 1.4 x t(1)), to show
#: how much the shared-vs-round-robin verdict depends on the shape of t(b)
FLAT_SERVICE_MS = (5.0, 0.03)
#: requests dropped from the statistics at the start, while queues fill
WARMUP_FRACTION = 0.1
#: and at the end, where arrivals stop and batches wait out their delay
COOLDOWN_FRACTION = 0.02
DONE, TIMER = 0, 1


@dataclass(frozen=True, slots=True)
class Service:
    """Batch service time t(b) = a + c·b, in seconds."""

    a_s: float
    c_s: float

    def time(self, batch: int) -> float:
        return self.a_s + self.c_s * batch

    def capacity(self, max_batch: int) -> float:
        """Inferences/s of one worker that always runs full batches."""
        return max_batch / self.time(max_batch)


@dataclass(frozen=True, slots=True)
class Batching:
    max_batch: int = 64
    delay_s: float = 1e-3


@dataclass(frozen=True, slots=True)
class RedisCost:
    us_per_batch: float
    us_per_request: float
    #: share of a model's Redis work on its own slot (the rest: gateways' reply streams)
    model_slot_share: float

    def us_per_inference(self, batch: float) -> float:
        return self.us_per_request + self.us_per_batch / batch

    def shard_rate(self, batch: float) -> float:
        """Inferences/s that keep one Redis core busy."""
        return 1e6 / self.us_per_inference(batch)


@dataclass(frozen=True, slots=True)
class Outcome:
    """Completion time of every request, and the size of every executed batch."""

    done: np.ndarray
    sizes: list[int]


@dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    workers: int
    load: float
    requests: int
    mean_batch: float
    largest_batch: int
    p50_ms: float
    p99_ms: float


@dataclass(slots=True)
class PullWorker:
    """One sluice worker as the pull policy sees it."""

    held: deque[int] = field(default_factory=deque)
    busy: bool = False
    reading: bool = False
    armed_at: float = -1.0


def poisson_arrivals(rate: float, count: int, seed: int) -> np.ndarray:
    return np.cumsum(np.random.default_rng(seed).exponential(1 / rate, count))


def central_batcher(
    arrivals: Sequence[float], instances: int, batching: Batching, service: Service
) -> Outcome:
    """One FIFO queue and its dynamic batcher feeding `instances` identical instances.

    Jumps from decision to decision (an instance frees, the queue reaches max_batch, the
    oldest request's delay runs out), so its cost is per batch, not per request.
    """
    n, size_cap, delay = len(arrivals), batching.max_batch, batching.delay_s
    done, sizes, running = np.empty(n), [], []
    free, head, now = instances, 0, arrivals[0] if n else 0.0
    while head < n:
        while running and running[0] <= now:
            heapq.heappop(running)
            free += 1
        arrived = bisect.bisect_right(arrivals, now, lo=head)
        while (
            free
            and head < arrived
            and (arrived - head >= size_cap or now >= arrivals[head] + delay)
        ):
            size = min(size_cap, arrived - head)
            end = now + service.time(size)
            done[head : head + size] = end
            head += size
            free -= 1
            sizes.append(size)
            heapq.heappush(running, end)
        now = _next_decision(arrivals, head, arrived, free, running, batching)
    return Outcome(done, sizes)


def _next_decision(
    arrivals: Sequence[float],
    head: int,
    arrived: int,
    free: int,
    running: list[float],
    batching: Batching,
) -> float:
    soonest = running[0] if running else math.inf
    if not free:
        return soonest
    if head < arrived:
        fills = head + batching.max_batch - 1
        full_at = arrivals[fills] if fills < len(arrivals) else math.inf
        return min(soonest, arrivals[head] + batching.delay_s, full_at)
    return min(soonest, arrivals[arrived]) if arrived < len(arrivals) else soonest


def shared_queue(
    arrivals: Sequence[float], workers: int, batching: Batching, service: Service
) -> Outcome:
    return central_batcher(arrivals, workers, batching, service)


def round_robin(
    arrivals: Sequence[float], workers: int, batching: Batching, service: Service
) -> Outcome:
    """Request i to server i mod workers; the servers never see each other's queues."""
    done, sizes = np.empty(len(arrivals)), []
    for k in range(workers):
        part = central_batcher(arrivals[k::workers], 1, batching, service)
        done[k::workers] = part.done
        sizes += part.sizes
    return Outcome(done, sizes)


class PullFleet:
    """sluice's reading: one blocking XREADGROUP per worker with a free instance and room.

    Redis serves blocked readers first come, first served, one new entry at a time; a worker
    re-issues its read before deciding on a batch, so a read that is open when the worker
    starts a batch still takes the next entry, which then waits for that batch to finish.
    """

    def __init__(
        self, arrivals: Sequence[float], workers: int, batching: Batching, service: Service
    ) -> None:
        self.arrivals, self.batching, self.service = arrivals, batching, service
        self.workers = [PullWorker() for _ in range(workers)]
        self.readers: deque[int] = deque()
        self.stream: deque[int] = deque()  # entries no reader took
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = itertools.count()
        self.done = np.empty(len(arrivals))
        self.sizes: list[int] = []

    def run(self) -> Outcome:
        for w in range(len(self.workers)):
            self._read(w)
        i, n = 0, len(self.arrivals)
        while i < n or self.events:
            if self.events and (i >= n or self.events[0][0] <= self.arrivals[i]):
                at, _, kind, w = heapq.heappop(self.events)
                if kind == DONE:
                    self._finished(w)
                self._read(w)
                self._decide(w, at)
            else:
                self._arrive(i)
                i += 1
        return Outcome(self.done, self.sizes)

    def _arrive(self, i: int) -> None:
        if not self.readers:
            self.stream.append(i)
            return
        w = self.readers.popleft()
        self.workers[w].reading = False
        self.workers[w].held.append(i)
        self._read(w)
        self._decide(w, self.arrivals[i])

    def _finished(self, w: int) -> None:
        """A batch ended: take what queued in the stream meanwhile (XREADGROUP COUNT)."""
        worker = self.workers[w]
        worker.busy = False
        while self.stream and len(worker.held) < self.batching.max_batch:
            worker.held.append(self.stream.popleft())

    def _read(self, w: int) -> None:
        worker = self.workers[w]
        if not worker.reading and not worker.busy and len(worker.held) < self.batching.max_batch:
            worker.reading = True
            self.readers.append(w)

    def _decide(self, w: int, now: float) -> None:
        worker = self.workers[w]
        if worker.busy or not worker.held:
            return
        oldest = self.arrivals[worker.held[0]]
        if len(worker.held) < self.batching.max_batch and now < oldest + self.batching.delay_s:
            due = oldest + self.batching.delay_s
            if worker.armed_at != due:
                worker.armed_at = due
                heapq.heappush(self.events, (due, next(self.seq), TIMER, w))
            return
        size = min(self.batching.max_batch, len(worker.held))
        end = now + self.service.time(size)
        for _ in range(size):
            self.done[worker.held.popleft()] = end
        worker.busy = True
        self.sizes.append(size)
        heapq.heappush(self.events, (end, next(self.seq), DONE, w))


def pull(arrivals: Sequence[float], workers: int, batching: Batching, service: Service) -> Outcome:
    return PullFleet(arrivals, workers, batching, service).run()


Policy = Callable[[Sequence[float], int, Batching, Service], Outcome]
POLICIES: dict[str, Policy] = {"shared": shared_queue, "pull": pull, "round_robin": round_robin}
REDIS_POLICIES = ("shared", "pull")


def simulate(
    policy: str,
    workers: int,
    load: float,
    requests: int,
    seed: int,
    batching: Batching,
    service: Service,
) -> SimResult:
    """One scenario; the same seed gives every policy the same arrival stream."""
    rate = load * workers * service.capacity(batching.max_batch)
    arrivals = poisson_arrivals(rate, requests, seed)
    outcome = POLICIES[policy](arrivals.tolist(), workers, batching, service)
    skip, keep = int(requests * WARMUP_FRACTION), int(requests * (1 - COOLDOWN_FRACTION))
    latency_ms = (outcome.done - arrivals)[skip:keep] * 1e3
    return SimResult(
        policy=policy,
        workers=workers,
        load=load,
        requests=requests,
        mean_batch=round(requests / len(outcome.sizes), 2),
        largest_batch=max(outcome.sizes),
        p50_ms=round(float(np.percentile(latency_ms, 50)), 2),
        p99_ms=round(float(np.percentile(latency_ms, 99)), 2),
    )


def redis_cores(rate: float, batch: float, cost: RedisCost) -> float:
    """Redis cores a fleet's traffic keeps busy at this mean batch size."""
    return rate * cost.us_per_inference(batch) / 1e6


def worker_limit(
    cost: RedisCost, batch: float, worker_rate: float, shards: int, hot_model: bool
) -> float:
    """Workers that K shards can serve before the busiest one reaches a full core.

    Many models spread over the shards by hash tag scale with K (assuming even spread); one
    hot model's request stream and statistics live on one slot, so only the reply streams
    (other gateways' slots) leave its shard and K beyond 2 buys it nothing.
    """
    rate = cost.shard_rate(batch)
    if hot_model and shards > 1:
        return rate / cost.model_slot_share / worker_rate
    return shards * rate / worker_rate


def calibration(path: Path | None) -> tuple[Service, RedisCost]:
    """Figures from a scale_workers.py JSON, or the defaults measured with it."""
    if path is None:
        return (
            Service(SERVICE_A_MS / 1e3, SERVICE_C_MS / 1e3),
            RedisCost(REDIS_US_PER_BATCH, REDIS_US_PER_REQUEST, MODEL_SLOT_SHARE),
        )
    data = json.loads(path.read_text())
    fit, cost = data["service_time"], data["redis_cost"]
    return (
        Service(fit["a_ms"] / 1e3, fit["c_ms"] / 1e3),
        RedisCost(cost["cpu_us_per_batch"], cost["cpu_us_per_request"], cost["model_slot_share"]),
    )


def run_grid(
    workers: Sequence[int],
    loads: Sequence[float],
    per_worker: int,
    seed: int,
    batching: Batching,
    service: Service,
) -> list[SimResult]:
    """Every policy at every (fleet size, load), each on the same arrivals."""
    rows = []
    for w, load in itertools.product(workers, loads):
        requests = max(40_000, per_worker * w)
        rows += [simulate(p, w, load, requests, seed, batching, service) for p in POLICIES]
    return rows


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
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    service, cost = calibration(args.calibration)
    flat = Service(FLAT_SERVICE_MS[0] / 1e3, FLAT_SERVICE_MS[1] / 1e3)
    batching = Batching()
    worker_rate = service.capacity(batching.max_batch)
    print(
        f"measured t(b) = {service.a_s * 1e3:.2f} ms + {service.c_s * 1e3:.3f} ms x b "
        f"(one worker: {worker_rate:,.0f} infer/s at batch {batching.max_batch}); "
        f"Redis {cost.us_per_batch:.0f} µs/batch + {cost.us_per_request:.1f} µs/request, "
        f"model-slot share {cost.model_slot_share:.0%}"
    )
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
    print(f"\nwrote {args.plot}; took {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "service": asdict(service),
            "flat_service": asdict(flat),
            "redis_cost": asdict(cost),
            "grids": {k: [asdict(r) for r in v] for k, v in grids.items()},
            "curves": {k: [asdict(r) for r in v] for k, v in curves.items()},
            "fleet_sizes": list(FLEET_SIZES),
            "fleet_mean_batch": fleet,
        }
        args.json.write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
