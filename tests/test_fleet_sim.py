"""The fleet simulation's core on small seeded scenarios: properties, never timings."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fleet_model
import fleet_partitions

BATCHING = fleet_model.Batching(max_batch=64, delay_s=1e-3)
MEASURED = fleet_model.Service(fleet_model.SERVICE_A_MS / 1e3, fleet_model.SERVICE_C_MS / 1e3)
#: batching nearly free: pooling requests can only help
FLAT = fleet_model.Service(5e-3, 0.03e-3)
COST = fleet_model.RedisCost(500.0, 10.0, 0.75)
REQUESTS = 20_000


@pytest.mark.parametrize("policy", list(fleet_model.POLICIES))
@pytest.mark.parametrize("service", [MEASURED, FLAT], ids=["measured", "flat"])
def test_every_request_runs_once_in_a_batch_within_limits(
    policy: str, service: fleet_model.Service
) -> None:
    arrivals_s = fleet_model.poisson_arrivals_s(8 * 0.9 * service.capacity(64), REQUESTS, seed=3)
    outcome = fleet_model.POLICIES[policy](arrivals_s.tolist(), 8, BATCHING, service)
    assert sum(outcome.sizes) == REQUESTS
    assert min(outcome.sizes) >= 1
    assert max(outcome.sizes) <= BATCHING.max_batch
    # no request finishes sooner than the smallest batch could run it
    assert np.all(outcome.done_s - arrivals_s >= service.time_s(1) - 1e-12)


def test_shared_queue_beats_round_robin_when_batching_is_nearly_free() -> None:
    shared = fleet_model.simulate("shared", 16, 0.8, REQUESTS, 1, BATCHING, FLAT)
    spread = fleet_model.simulate("round_robin", 16, 0.8, REQUESTS, 1, BATCHING, FLAT)
    assert shared.p99_ms <= spread.p99_ms
    assert shared.mean_batch >= spread.mean_batch


def test_same_seed_same_result() -> None:
    runs = [fleet_model.simulate("pull", 4, 0.8, 5_000, 7, BATCHING, MEASURED) for _ in range(2)]
    assert runs[0] == runs[1]


def test_redis_cost_per_inference_falls_with_batch_size() -> None:
    costs = [COST.us_per_inference(b) for b in (1, 8, 32, 64)]
    assert costs == sorted(costs, reverse=True)
    assert COST.shard_rate(64) == pytest.approx(1e6 / (10.0 + 500.0 / 64))


def test_shards_raise_the_limit_except_for_one_hot_model() -> None:
    spread = [fleet_model.worker_limit(COST, 32, 1000, k, hot_model=False) for k in (1, 2, 4, 8)]
    hot = [fleet_model.worker_limit(COST, 32, 1000, k, hot_model=True) for k in (1, 2, 4, 8)]
    assert all(b > a for a, b in itertools.pairwise(spread))
    assert spread[2] == pytest.approx(4 * spread[0])
    # one model's stream lives on one shard: only its reply traffic leaves it
    assert hot[0] == spread[0]
    assert hot[1] == hot[2] == hot[3] == pytest.approx(spread[0] / COST.model_slot_share)


def _partitioned(partitions: int, reads: int = 0) -> tuple[fleet_model.Outcome, float]:
    """16 workers at 80 % load, seeded: the outcome and the seconds its arrivals span."""
    arrivals_s = fleet_model.poisson_arrivals_s(16 * 0.8 * MEASURED.capacity(64), REQUESTS, seed=5)
    fleet = fleet_model.PullFleet(arrivals_s.tolist(), 16, BATCHING, MEASURED, partitions, reads)
    return fleet.run(), float(arrivals_s[-1] - arrivals_s[0])


def test_partitions_run_every_request_once_and_share_them_evenly() -> None:
    outcome, _ = _partitioned(4)
    assert sum(outcome.sizes) == REQUESTS
    assert max(outcome.sizes) <= BATCHING.max_batch
    # the gateways deal in turn, and no partition falls a batch behind here
    assert max(outcome.entries) - min(outcome.entries) <= 1
    # every worker reads every partition, so a batch holds requests of several
    assert sum(outcome.draws) > 2 * len(outcome.sizes)


def test_partitions_spread_redis_cost_over_shards() -> None:
    outcome, span_s = _partitioned(4)
    spread = fleet_partitions.shard_cores(outcome, span_s, COST, shards=4)
    assert spread.max() / spread.mean() < 1.05
    one, span_s = _partitioned(1)
    hot = fleet_partitions.shard_cores(one, span_s, COST, shards=4)
    # one partition: the model's keys on shard 0, only the reply streams' part elsewhere
    share = COST.model_slot_share + (1 - COST.model_slot_share) / 4
    assert hot[0] / hot.sum() == pytest.approx(share)
    assert hot[1] == pytest.approx(hot[2]) == pytest.approx(hot[3])
    # and the same traffic on one shard costs what the unpartitioned model does
    assert fleet_partitions.shard_cores(one, span_s, COST, shards=1)[0] == pytest.approx(hot.sum())


def test_reading_fewer_partitions_draws_fewer_per_batch() -> None:
    every, _ = _partitioned(8)
    two, _ = _partitioned(8, reads=2)
    assert sum(two.sizes) == REQUESTS
    assert sum(two.draws) <= 2 * len(two.sizes) < sum(every.draws)


def test_a_partition_no_worker_reads_is_refused() -> None:
    with pytest.raises(ValueError, match="unread"):
        fleet_model.PullFleet([0.0], 2, BATCHING, MEASURED, partitions=8, reads=2)


def test_partitions_lift_one_hot_models_limit() -> None:
    results = [
        fleet_partitions.hot_model(
            fleet_partitions.Cluster(k, k, 256), 0.8, 100, 1, BATCHING, MEASURED, COST
        )
        for k in (1, 4)
    ]
    assert results[0].redis_bound
    assert results[1].infer_s > results[0].infer_s
