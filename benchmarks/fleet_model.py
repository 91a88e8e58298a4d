"""The fleet simulation itself: workers, batchers, the three ways to reach them, Redis cost.

`benchmarks/fleet_sim.py` runs it over fleet sizes and loads and reports the figures.

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
  next worker to free up takes up to max_batch of them at once. With P partitions (one hot
  model's stream split over P hash tags, partition p on shard p mod S) the gateways deal
  entries to the partitions in turn, passing over one whose backlog is a full batch above the
  shallowest; every worker keeps a read open on each partition (or, as an alternative, on
  `reads` of them in a row) and, freeing up, asks each for its share of the room (rounded
  up), so a batch may hold requests of several partitions;
* round_robin: each server its own dynamic batcher, requests dealt in turn (Triton behind
  a round-robin load balancer).

How the partitions' Redis cost falls on the shards is `fleet_partitions.py`'s.

Not modelled: network time, the gateway, the gateway grouping requests that arrive together
into one stream entry (one request per entry here), uneven hash-slot spread, Redis queueing
before a shard saturates, and failures.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: Measured on 2026-11-29 (x86_64, 2 cores, other work running) by
#: `python benchmarks/scale_workers.py`: the MLP alone, 1 thread (397, 1,049, 2,731 and 3,215
#: infer/s at batch 1, 8, 32, 64), fitted to t(b) = a + c·b ...
SERVICE_A_MS = 2.484
SERVICE_C_MS = 0.298
#: Redis CPU per executed batch and per request: 2026-11-29's least-squares split (588.8 µs +
#: 11.3 µs, `scale_workers.py`) scaled to 2026-12-01's 9.6 µs per inference at batch 31 (298 µs
#: per batch, `benchmarks/redis_cost.py`, after the plain ack path), which measured no split
#: of its own (its 64 B against 2 KiB payloads put ~3 µs per request, near this 3.58).
REDIS_US_PER_BATCH = 186.6
REDIS_US_PER_REQUEST = 3.58
#: the share of Redis command time on the model's own keys (its Cluster slot), 2026-11-29 ...
MODEL_SLOT_SHARE = 0.732
#: ... and of a batch's cost, the part that is the worker's read and ack (2 of the ~5 client
#: events per batch of 2026-12-01's perf record: reads 1.5, the ack half of the reply
#: pipeline 0.5), paid once per partition a batch drew from.
READ_SHARE = 0.4

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

    def time_s(self, batch: int) -> float:
        return self.a_s + self.c_s * batch

    def capacity(self, max_batch: int) -> float:
        """Inferences/s of one worker that always runs full batches."""
        return max_batch / self.time_s(max_batch)


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
    #: share of the per-batch cost paid again for each partition a batch drew from
    read_share: float = READ_SHARE

    def us_per_inference(self, batch: float) -> float:
        return self.us_per_request + self.us_per_batch / batch

    def shard_rate(self, batch: float) -> float:
        """Inferences/s that keep one Redis core busy."""
        return 1e6 / self.us_per_inference(batch)


@dataclass(frozen=True, slots=True)
class Outcome:
    """Completion time of every request, and the size of every executed batch.

    With partitions, also per partition: the batches that drew from it and its requests
    (empty: one partition).
    """

    done_s: np.ndarray
    sizes: list[int]
    draws: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)


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
    """One sluice worker as the pull policy sees it: a blocking read per partition."""

    reading: list[bool]
    held: deque[int] = field(default_factory=deque)
    busy: bool = False
    armed_at_s: float = -1.0


def poisson_arrivals_s(rate: float, count: int, seed: int) -> np.ndarray:
    return np.cumsum(np.random.default_rng(seed).exponential(1 / rate, count))


def central_batcher(
    arrivals_s: Sequence[float], instances: int, batching: Batching, service: Service
) -> Outcome:
    """One FIFO queue and its dynamic batcher feeding `instances` identical instances.

    Jumps from decision to decision (an instance frees, the queue reaches max_batch, the
    oldest request's delay runs out), so its cost is per batch, not per request.
    """
    n, size_cap, delay_s = len(arrivals_s), batching.max_batch, batching.delay_s
    done_s, sizes = np.empty(n), []
    running_s: list[float] = []
    free, head, now_s = instances, 0, arrivals_s[0] if n else 0.0
    while head < n:
        while running_s and running_s[0] <= now_s:
            heapq.heappop(running_s)
            free += 1
        arrived = bisect.bisect_right(arrivals_s, now_s, lo=head)
        while (
            free
            and head < arrived
            and (arrived - head >= size_cap or now_s >= arrivals_s[head] + delay_s)
        ):
            size = min(size_cap, arrived - head)
            end_s = now_s + service.time_s(size)
            done_s[head : head + size] = end_s
            head += size
            free -= 1
            sizes.append(size)
            heapq.heappush(running_s, end_s)
        now_s = _next_decision_s(arrivals_s, head, arrived, free, running_s, batching)
    return Outcome(done_s, sizes)


def _next_decision_s(
    arrivals_s: Sequence[float],
    head: int,
    arrived: int,
    free: int,
    running_s: list[float],
    batching: Batching,
) -> float:
    soonest_s = running_s[0] if running_s else math.inf
    if not free:
        return soonest_s
    if head < arrived:
        fills = head + batching.max_batch - 1
        full_at_s = arrivals_s[fills] if fills < len(arrivals_s) else math.inf
        return min(soonest_s, arrivals_s[head] + batching.delay_s, full_at_s)
    return min(soonest_s, arrivals_s[arrived]) if arrived < len(arrivals_s) else soonest_s


def shared_queue(
    arrivals_s: Sequence[float], workers: int, batching: Batching, service: Service
) -> Outcome:
    return central_batcher(arrivals_s, workers, batching, service)


def round_robin(
    arrivals_s: Sequence[float], workers: int, batching: Batching, service: Service
) -> Outcome:
    """Request i to server i mod workers; the servers never see each other's queues."""
    done_s, sizes = np.empty(len(arrivals_s)), []
    for k in range(workers):
        part = central_batcher(arrivals_s[k::workers], 1, batching, service)
        done_s[k::workers] = part.done_s
        sizes += part.sizes
    return Outcome(done_s, sizes)


class PullFleet:
    """sluice's reading: a blocking XREADGROUP per partition and worker with a free instance
    and room.

    Redis serves blocked readers first come, first served, one new entry at a time; a worker
    re-issues its read before deciding on a batch, so a read that is open when the worker
    starts a batch still takes the next entry, which then waits for that batch to finish.
    """

    def __init__(
        self,
        arrivals_s: Sequence[float],
        workers: int,
        batching: Batching,
        service: Service,
        partitions: int = 1,
        reads: int = 0,
    ) -> None:
        self.arrivals_s, self.batching, self.service = arrivals_s, batching, service
        self.every = range(partitions)
        #: the partitions each worker reads: all, or `reads` in a row from its place in the fleet
        self.own = [
            tuple((w * partitions // workers + j) % partitions for j in range(reads or partitions))
            for w in range(workers)
        ]
        if len(set(itertools.chain(*self.own))) < partitions:
            raise ValueError(f"{workers} workers reading {reads} each leave a partition unread")
        self.workers = [PullWorker([False] * partitions) for _ in range(workers)]
        self.readers: list[deque[int]] = [deque() for _ in self.every]
        self.streams: list[deque[int]] = [deque() for _ in self.every]  # entries no reader took
        self.backlog = 0
        self.turn = itertools.count()
        self.partition = [0] * len(arrivals_s)
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = itertools.count()
        self.done_s = np.empty(len(arrivals_s))
        self.sizes: list[int] = []
        self.draws = [0] * partitions
        self.entries = [0] * partitions

    def run(self) -> Outcome:
        for w in range(len(self.workers)):
            self._read(w, self.own[w])
        i, n = 0, len(self.arrivals_s)
        while i < n or self.events:
            if self.events and (i >= n or self.events[0][0] <= self.arrivals_s[i]):
                at_s, _, kind, w = heapq.heappop(self.events)
                if kind == DONE:
                    self._finished(w)
                self._read(w, self.own[w])
                self._decide(w, at_s)
            else:
                self._arrive(i)
                i += 1
        return Outcome(self.done_s, self.sizes, self.draws, self.entries)

    def _deal(self) -> int:
        """The gateway's turn, passing over a partition a full batch deeper than the others."""
        count = len(self.streams)
        p = next(self.turn) % count
        if self.backlog > self.batching.max_batch:
            shallowest = min(len(s) for s in self.streams)
            while len(self.streams[p]) > shallowest + self.batching.max_batch:
                p = next(self.turn) % count
        return p

    def _arrive(self, i: int) -> None:
        p = self._deal()
        self.partition[i] = p
        self.entries[p] += 1
        if not self.readers[p]:
            self.streams[p].append(i)
            self.backlog += 1
            return
        w = self.readers[p].popleft()
        self.workers[w].reading[p] = False
        self.workers[w].held.append(i)
        self._read(w, (p,))
        self._decide(w, self.arrivals_s[i])

    def _finished(self, w: int) -> None:
        """A batch ended: take what queued meanwhile, each partition its share of the room
        (XREADGROUP COUNT), again while room and entries are left."""
        worker = self.workers[w]
        worker.busy = False
        room, taken = self.batching.max_batch - len(worker.held), self.backlog
        while room > 0 and taken:
            ask, taken = -(-room // len(self.own[w])), 0
            for p in self.own[w]:
                stream = self.streams[p]
                for _ in range(min(ask, len(stream))):
                    worker.held.append(stream.popleft())
                    taken += 1
            self.backlog -= taken
            room = self.batching.max_batch - len(worker.held)

    def _read(self, w: int, partitions: Sequence[int]) -> None:
        worker = self.workers[w]
        if worker.busy or len(worker.held) >= self.batching.max_batch:
            return
        for p in partitions:
            if not worker.reading[p]:
                worker.reading[p] = True
                self.readers[p].append(w)

    def _decide(self, w: int, now_s: float) -> None:
        worker = self.workers[w]
        if worker.busy or not worker.held:
            return
        oldest_s = self.arrivals_s[worker.held[0]]
        if len(worker.held) < self.batching.max_batch and now_s < oldest_s + self.batching.delay_s:
            due_s = oldest_s + self.batching.delay_s
            if worker.armed_at_s != due_s:
                worker.armed_at_s = due_s
                heapq.heappush(self.events, (due_s, next(self.seq), TIMER, w))
            return
        size = min(self.batching.max_batch, len(worker.held))
        end_s = now_s + self.service.time_s(size)
        drawn = set()
        for _ in range(size):
            i = worker.held.popleft()
            self.done_s[i] = end_s
            drawn.add(self.partition[i])
        for p in drawn:
            self.draws[p] += 1
        worker.busy = True
        self.sizes.append(size)
        heapq.heappush(self.events, (end_s, next(self.seq), DONE, w))


def pull(
    arrivals_s: Sequence[float], workers: int, batching: Batching, service: Service
) -> Outcome:
    return PullFleet(arrivals_s, workers, batching, service).run()


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
    arrivals_s = poisson_arrivals_s(rate, requests, seed)
    outcome = POLICIES[policy](arrivals_s.tolist(), workers, batching, service)
    skip, keep = int(requests * WARMUP_FRACTION), int(requests * (1 - COOLDOWN_FRACTION))
    latency_ms = (outcome.done_s - arrivals_s)[skip:keep] * 1e3
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
