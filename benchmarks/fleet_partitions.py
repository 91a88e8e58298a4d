"""One hot model over the shards of a Redis Cluster: its stream split into partitions
(shared/partitions.py), each shard charged for the partitions it holds.

The fleet itself is `fleet_model.PullFleet` with partitions; `fleet_sim.py --partitions-sweep`
runs `hot_model` over `sweep_clusters()` and reports the figures.

The part of a batch's Redis cost on the model's keys that is one read and one ack
(`RedisCost.read_share`) is paid once per partition the batch drew from, on that partition's
shard; the rest on the model's keys (its request entries) is paid where its requests were;
the reply streams' part is spread evenly over the shards (many gateways, each reply stream its
own hash tag).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from fleet_model import (
    COOLDOWN_FRACTION,
    WARMUP_FRACTION,
    Batching,
    Outcome,
    PullFleet,
    RedisCost,
    Service,
    poisson_arrivals_s,
)

#: the partition sweep's cluster sizes and fleets (partitions = shards, and some beyond)
SWEEP_SHARDS = (1, 2, 4, 8, 16, 32)
SWEEP_WORKERS = (16, 64, 256, 1000)
#: (shards, partitions) beyond partitions = shards
SWEEP_EXTRA = ((4, 8), (16, 32))
#: partitions a worker reads in the sweep's alternative to reading all of them
SWEEP_READS = 2


@dataclass(frozen=True, slots=True)
class PartitionResult:
    """One hot model on a cluster: what it sustains before its busiest shard is one core."""

    shards: int
    partitions: int
    workers: int
    #: partitions each worker reads (0: all of them)
    reads: int
    #: the load offered (of the workers' full-batch capacity)
    load: float
    #: the offered rate, or the rate at which the busiest shard reaches one core
    infer_s: float
    mean_batch: float
    #: partitions a batch drew from, on average
    batch_partitions: float
    redis_us_per_inference: float
    #: the busiest shard's CPU over the mean shard's at this load
    imbalance: float
    p99_ms: float
    #: True when Redis, not the workers, sets infer_s
    redis_bound: bool


def shard_cores(outcome: Outcome, span_s: float, cost: RedisCost, shards: int) -> np.ndarray:
    """Redis cores each shard spends on one model's traffic, partition p on shard p mod shards.

    A batch pays its read and ack on each partition it drew from, its request entries where
    its requests were; the reply streams' part spreads evenly over the shards.
    """
    batches, requests = len(outcome.sizes), sum(outcome.sizes)
    draws = np.array(outcome.draws or [batches], dtype=float)
    entries = np.array(outcome.entries or [requests], dtype=float)
    entry_share = cost.model_slot_share - cost.read_share
    model_us = (
        cost.us_per_batch * (cost.read_share * draws + entry_share * batches * entries / requests)
        + cost.us_per_request * cost.model_slot_share * entries
    )
    cores = np.zeros(shards)
    np.add.at(cores, np.arange(len(draws)) % shards, model_us)
    reply_share = 1 - cost.model_slot_share
    cores += reply_share * (cost.us_per_batch * batches + cost.us_per_request * requests) / shards
    return cores / span_s / 1e6


@dataclass(frozen=True, slots=True)
class Cluster:
    """One hot model's fleet: its workers, its stream's partitions, the cluster's shards."""

    shards: int
    partitions: int
    workers: int
    #: partitions each worker reads (0: all of them)
    reads: int = 0


def hot_model(
    cluster: Cluster,
    load: float,
    per_worker: int,
    seed: int,
    batching: Batching,
    service: Service,
    cost: RedisCost,
) -> PartitionResult:
    """What one hot model sustains at this load's batch sizes: the offered rate, or the rate
    at which its busiest shard reaches one core if that is lower."""
    rate = load * cluster.workers * service.capacity(batching.max_batch)
    requests = max(20_000, per_worker * cluster.workers)
    arrivals_s = poisson_arrivals_s(rate, requests, seed)
    outcome = PullFleet(
        arrivals_s.tolist(), cluster.workers, batching, service, cluster.partitions, cluster.reads
    ).run()
    cores = shard_cores(outcome, float(arrivals_s[-1] - arrivals_s[0]), cost, cluster.shards)
    skip, keep = int(requests * WARMUP_FRACTION), int(requests * (1 - COOLDOWN_FRACTION))
    latency_ms = (outcome.done_s - arrivals_s)[skip:keep] * 1e3
    busiest, batches = float(cores.max()), len(outcome.sizes)
    return PartitionResult(
        shards=cluster.shards,
        partitions=cluster.partitions,
        workers=cluster.workers,
        reads=cluster.reads,
        load=load,
        infer_s=round(rate / max(1.0, busiest)),
        mean_batch=round(requests / batches, 2),
        batch_partitions=round(sum(outcome.draws) / batches, 2),
        redis_us_per_inference=round(float(cores.sum()) * 1e6 / rate, 2),
        imbalance=round(busiest / float(cores.mean()), 3),
        p99_ms=round(float(np.percentile(latency_ms, 99)), 2),
        redis_bound=busiest > 1,
    )


def sweep_clusters() -> list[Cluster]:
    """Partitions = shards for each cluster size and fleet, every worker reading every
    partition, then each reading SWEEP_READS, then more partitions than shards."""
    clusters = [Cluster(k, k, w) for k in SWEEP_SHARDS for w in SWEEP_WORKERS]
    clusters += [
        Cluster(k, k, w, SWEEP_READS)
        for k in SWEEP_SHARDS
        for w in SWEEP_WORKERS
        if k > SWEEP_READS
    ]
    return clusters + [Cluster(k, p, w) for k, p in SWEEP_EXTRA for w in SWEEP_WORKERS]
