"""A worker's statistics under load: held back while work is in hand, then written summed."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from sluice.shared import keys
from sluice.shared.redis_client import async_client
from sluice.shared.stats import FOLD_AT, BatchStats, read_stats_command, stats_hash
from sluice.workers.answers.publisher import STATS_FLUSH_S, Publisher


class Clock:
    """An injectable monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = async_client(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def publisher(redis: aioredis.Redis, clock: Clock) -> AsyncIterator[Publisher]:
    publisher = Publisher(redis, "m", set(), clock_s=clock)
    yield publisher
    await publisher.close()


def _batch(size: int, at_ms: int) -> list[str | int]:
    stats = BatchStats(1, size, at_ms)
    stats.requests_ok = size
    stats.queue_samples_ns = [1_000] * size
    stats.request_samples_ns = [2_000] * size
    return stats.increments()


async def _stats(redis: aioredis.Redis) -> dict[bytes, bytes]:
    return stats_hash(await redis.execute_command(*read_stats_command("m")))


async def test_statistics_wait_while_work_is_in_hand_then_go_summed(
    redis: aioredis.Redis, publisher: Publisher, clock: Clock
) -> None:
    await publisher.publish([], [], _batch(3, 1_000), defer_statistics=True)
    clock.now += STATS_FLUSH_S / 2
    await publisher.publish([], [], _batch(5, 2_000), defer_statistics=True)
    assert await _stats(redis) == {}
    await publisher.publish([], [], _batch(2, 1_500))  # nothing else in hand
    stats = await _stats(redis)
    assert stats[b"1:inference_count"] == b"10"
    assert stats[b"1:execution_count"] == b"3"
    assert stats[b"1:success_count"] == b"10"
    assert stats[b"1:last_inference"] == b"2000"  # the latest, not a sum
    assert (stats[b"1:b3:count"], stats[b"1:b5:count"], stats[b"1:b2:count"]) == (b"1",) * 3


async def test_held_back_statistics_are_written_once_the_flush_interval_has_passed(
    redis: aioredis.Redis, publisher: Publisher, clock: Clock
) -> None:
    await publisher.publish([], [], _batch(4, 1_000), defer_statistics=True)
    assert await _stats(redis) == {}
    clock.now += STATS_FLUSH_S + 0.001
    await publisher.publish([], [], _batch(4, 1_100), defer_statistics=True)
    assert (await _stats(redis))[b"1:inference_count"] == b"8"
    await publisher.publish([], [], _batch(1, 1_200), defer_statistics=True)
    assert (await _stats(redis))[b"1:inference_count"] == b"8"  # a new interval has begun


async def test_each_batch_is_logged_then_folded_in_when_read_the_latest_time_kept(
    redis: aioredis.Redis, publisher: Publisher
) -> None:
    await publisher.publish([], [], _batch(3, 2_000))
    await publisher.publish([], [], _batch(4, 1_000))
    assert await redis.hgetall(keys.model_stats("m")) == {}  # logged, not yet in the hash
    assert await redis.llen(keys.model_stats_log("m")) == 2
    stats = await _stats(redis)  # a reader folds the log in first
    assert stats[b"1:inference_count"] == b"7"
    assert stats[b"1:queue_ns"] == b"7000"
    assert stats[b"1:last_inference"] == b"2000"
    assert await redis.llen(keys.model_stats_log("m")) == 0
    await publisher.publish([], [], _batch(1, 1_500))
    stats = await _stats(redis)  # counters add to the hash; an earlier time does not replace
    assert (stats[b"1:inference_count"], stats[b"1:last_inference"]) == (b"8", b"2000")


async def test_a_worker_folds_the_log_in_itself_once_it_holds_fold_at_records(
    redis: aioredis.Redis, publisher: Publisher
) -> None:
    for i in range(FOLD_AT + 1):
        await publisher.publish([], [], _batch(2, 1_000 + i))
    assert await redis.llen(keys.model_stats_log("m")) == 1
    folded = await redis.hgetall(keys.model_stats("m"))
    assert folded[b"1:inference_count"] == str(2 * FOLD_AT).encode()
    assert folded[b"1:last_inference"] == str(1_000 + FOLD_AT - 1).encode()
    assert (await _stats(redis))[b"1:inference_count"] == str(2 * FOLD_AT + 2).encode()


def test_a_request_answered_with_an_error_counts_as_a_failure_alone() -> None:
    """As Triton counts a request its backend failed: the failure and its duration, no queue
    or compute sample, while the batch's size still counts it."""
    stats = BatchStats(1, 3, 0, queue_samples_ns=[5, 6, 7], infer_ns=100)
    stats.settle([0, 10, 20], [False, True, False], finished_ns=50)
    counts = dict(zip(stats.increments()[::2], stats.increments()[1::2], strict=True))
    assert (counts["1:success_count"], counts["1:success_ns"]) == (2, 50 + 30)
    assert (counts["1:fail_count"], counts["1:fail_ns"], counts["1:failure:BACKEND"]) == (1, 40, 1)
    assert (counts["1:queue_count"], counts["1:queue_ns"]) == (2, 5 + 7)
    assert (counts["1:compute_infer_count"], counts["1:compute_infer_ns"]) == (2, 200)
    assert (counts["1:inference_count"], counts["1:execution_count"]) == (3, 1)
