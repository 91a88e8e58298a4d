"""What lets a job in: the same `max_queue_size` admission as infer requests (the counter stays
exact), its id (an idempotency key: the same request again is the same job, another one a
Conflict) and the number of jobs kept (--max-jobs).

Real Redis; the test plays the worker with the worker's own Publisher, whose finishing script
lowers the counter as it answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis.asyncio as aioredis
from sluice.gateway.dispatcher import Dispatcher, Route
from sluice.gateway.jobs import JobStore
from sluice.shared import keys
from sluice.shared.errors import Conflict, Unavailable
from sluice.shared.jobs import request_digest
from sluice.shared.protocol import Request, Result, Tensor, decode_requests, decode_results
from sluice.shared.redis_client import async_client
from sluice.shared.registry import encode_model_record
from sluice.workers.answers.publisher import Publisher
from sluice.workers.batching.batcher import Pending
from sluice.workers.batching.pending import Queued

from sluice.client import RedisClient
from sluice.client.errors import Conflict as ClientConflict
from sluice.client.errors import Unavailable as ClientUnavailable

MODEL = "bounded"
ROUTE = Route(MODEL, level=0, max_queue_size=3)
META = {"model": MODEL, "version": 1, "client_id": None, "outputs": None, "binary": False}
#: a model with no queue limit, for the tests of ids and of the jobs kept.
PLAIN = "plain"
PLAIN_ROUTE = Route(PLAIN, level=0)
PLAIN_META = META | {"model": PLAIN}


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = async_client(redis_url)
    yield client
    await client.aclose()


def _job(job_id: str) -> Request:
    return Request(job_id, 1, 0, keys.job_stream(job_id), [Tensor("IN", "INT8", (1,), b"\x01")])


async def _counter(redis: aioredis.Redis) -> int:
    return int(await redis.hget(keys.queue_sizes(MODEL), "0") or 0)


async def _queued(redis: aioredis.Redis) -> int:
    return int(await redis.xlen(keys.request_stream(MODEL)))


async def _answer_everything(redis: aioredis.Redis) -> list[str]:
    """Read the queue as a worker does and answer it with the worker's publisher."""
    stream = keys.request_stream(MODEL)
    await redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
    read = await redis.xreadgroup(keys.WORKER_GROUP, "w", {stream: ">"}, count=100)
    items = [
        Queued(request, stream, entry_id, Pending(1, 1, 0))
        for _, entries in read
        for entry_id, fields in entries
        for request in decode_requests(fields)
    ]
    publisher = Publisher(redis, MODEL, counted_levels={0})
    await publisher.publish(items, [Result(item.request.id) for item in items])
    await publisher.close()
    return [item.request.id for item in items]


async def test_a_job_counts_against_the_queue_limit_like_an_infer(redis: aioredis.Redis) -> None:
    dispatcher = Dispatcher(redis, redis, "gw-admission")
    jobs = JobStore(redis, redis, ttl_s=60)
    request = Request(dispatcher.new_request_id(), 1, 0, dispatcher.reply_stream, [])
    infer = asyncio.create_task(dispatcher.submit(ROUTE, request, 30))
    assert await jobs.submit(_job("job-1"), ROUTE, META, "digest")
    assert await jobs.submit(_job("job-2"), ROUTE, META, "digest")
    while await _queued(redis) < 3:  # the infer goes out on the loop's next turn
        await asyncio.sleep(0)
    assert await _counter(redis) == await _queued(redis) == 3

    with pytest.raises(Unavailable, match=r"\[request id: job-3\] Exceeds maximum queue size"):
        await jobs.submit(_job("job-3"), ROUTE, META, "digest")
    assert not await redis.exists(keys.job_stream("job-3"))  # free to submit again later
    assert await _counter(redis) == await _queued(redis) == 3

    answered = await _answer_everything(redis)
    assert sorted(answered) == sorted([request.id, "job-1", "job-2"])
    assert await _counter(redis) == await _queued(redis) == 0
    ((_, reply),) = await redis.xrange(dispatcher.reply_stream)
    assert [result.id for result in decode_results(reply)] == [request.id]
    assert await redis.xlen(keys.job_stream("job-1")) == 2  # metadata, then the result

    assert await jobs.submit(_job("job-3"), ROUTE, META, "digest")  # room again
    assert await _counter(redis) == await _queued(redis) == 1
    infer.cancel()
    await dispatcher.close()


async def test_a_job_submitted_straight_to_redis_passes_the_same_admission(
    redis_url: str, redis: aioredis.Redis
) -> None:
    config = {
        "name": MODEL,
        "dynamic_batching": {"default_queue_policy": {"max_queue_size": 2}},
    }
    await redis.hset(keys.MODELS, MODEL, encode_model_record(config, [1], None))
    client = RedisClient(redis_url)
    inputs = {"IN": np.ones((1,), dtype=np.int8)}
    client.submit(MODEL, inputs, job_id="direct-1")
    client.submit(MODEL, inputs, job_id="direct-2")
    with pytest.raises(ClientUnavailable, match="Exceeds maximum queue size"):
        client.submit(MODEL, inputs, job_id="direct-3")
    client.close()
    assert not await redis.exists(keys.job_stream("direct-3"))
    assert await _counter(redis) == await _queued(redis) == 2


# --- job ids and the jobs kept --------------------------------------------------------------


def _keyed_job(job_id: str, value: int = 1) -> tuple[Request, str]:
    tensor = Tensor("IN", "INT8", (1,), bytes([value]))
    request = Request(job_id, 1, 0, keys.job_stream(job_id), [tensor])
    return request, request_digest(PLAIN, "", [tensor], {}, None)


async def _submit(jobs: JobStore, job_id: str, value: int = 1) -> bool:
    request, digest = _keyed_job(job_id, value)
    return await jobs.submit(request, PLAIN_ROUTE, PLAIN_META, digest)


def test_the_digest_tells_requests_apart_and_not_their_encoding() -> None:
    x = Tensor("X", "FP32", (1, 2), b"\0" * 8)
    y = Tensor("Y", "INT8", (1,), b"\1")
    same = request_digest("m", "", [x, y], {"a": 1, "b": 2}, None)
    assert request_digest("m", "", [y, x], {"b": 2, "a": 1}, None) == same
    assert (
        request_digest(
            "m", "", [x, Tensor("Y", "INT8", (1,), memoryview(b"\1"))], {"a": 1, "b": 2}, None
        )
        == same
    )
    others = [
        request_digest("n", "", [x, y], {"a": 1, "b": 2}, None),
        request_digest("m", "1", [x, y], {"a": 1, "b": 2}, None),
        request_digest("m", "", [x, Tensor("Y", "INT8", (1,), b"\2")], {"a": 1, "b": 2}, None),
        request_digest("m", "", [x, Tensor("Y", "UINT8", (1,), b"\1")], {"a": 1, "b": 2}, None),
        request_digest("m", "", [x, Tensor("Y", "INT8", (1, 1), b"\1")], {"a": 1, "b": 2}, None),
        request_digest("m", "", [x, y], {"a": 1}, None),
        request_digest("m", "", [x, y], {"a": 1, "b": 2}, {"X": None}),
    ]
    assert same not in others and len(set(others)) == len(others)


async def test_an_id_sent_again_is_its_job_for_the_same_request_and_409_otherwise(
    redis: aioredis.Redis,
) -> None:
    jobs = JobStore(redis, redis, ttl_s=60)
    assert await _submit(jobs, "j-1")
    assert not await _submit(jobs, "j-1")
    with pytest.raises(Conflict, match="job 'j-1' already exists for another request"):
        await _submit(jobs, "j-1", value=2)
    assert await redis.xlen(keys.request_stream(PLAIN)) == 1  # queued once


async def test_two_concurrent_submits_of_one_id_cannot_both_win(redis: aioredis.Redis) -> None:
    jobs = JobStore(redis, redis, ttl_s=60)
    for round_ in range(20):
        job_id = f"race-{round_}"
        outcomes = await asyncio.gather(
            _submit(jobs, job_id, 1), _submit(jobs, job_id, 2), return_exceptions=True
        )
        wins = [o for o in outcomes if o is True]
        conflicts = [o for o in outcomes if isinstance(o, Conflict)]
        assert (len(wins), len(conflicts)) == (1, 1), outcomes
    assert await redis.xlen(keys.request_stream(PLAIN)) == 20


async def test_jobs_kept_are_bounded_and_a_resubmission_is_never_refused(
    redis: aioredis.Redis,
) -> None:
    jobs = JobStore(redis, redis, ttl_s=60, max_jobs=2)
    assert await _submit(jobs, "q-1")
    assert await _submit(jobs, "q-2")
    with pytest.raises(Unavailable, match=r"too many jobs: 2 are kept already \(--max-jobs\)"):
        await _submit(jobs, "q-3")
    assert not await redis.exists(keys.job_stream("q-3"))
    assert not await _submit(jobs, "q-1")  # the same job again, at the limit
    with pytest.raises(Conflict):
        await _submit(jobs, "q-2", value=9)
    assert await redis.zcard(keys.JOBS_KEPT) == 2


async def test_a_job_refused_by_the_queue_limit_is_not_counted(redis: aioredis.Redis) -> None:
    jobs = JobStore(redis, redis, ttl_s=60, max_jobs=5)
    bounded = Route(PLAIN, level=0, max_queue_size=1)
    request, digest = _keyed_job("a-1")
    assert await jobs.submit(request, bounded, PLAIN_META, digest)
    request, digest = _keyed_job("a-2")
    with pytest.raises(Unavailable, match="Exceeds maximum queue size"):
        await jobs.submit(request, bounded, PLAIN_META, digest)
    assert await redis.zrange(keys.JOBS_KEPT, 0, -1) == [b"a-1"]


async def test_a_kept_job_stops_counting_when_it_expires(redis: aioredis.Redis) -> None:
    jobs = JobStore(redis, redis, ttl_s=60, max_jobs=1)
    assert await _submit(jobs, "e-1")
    await redis.zadd(keys.JOBS_KEPT, {"e-1": 1})  # as if its TTL had ended long ago
    assert await _submit(jobs, "e-2")
    assert await redis.zrange(keys.JOBS_KEPT, 0, -1) == [b"e-2"]


async def test_a_job_submitted_straight_to_redis_keeps_its_id_to_its_request(
    redis_url: str, redis: aioredis.Redis
) -> None:
    await redis.hset(keys.MODELS, PLAIN, encode_model_record({"name": PLAIN}, [1], None))
    client = RedisClient(redis_url)
    inputs = {"IN": np.ones((1,), dtype=np.int8)}
    first = client.submit(PLAIN, inputs, job_id="direct-1")
    assert client.submit(PLAIN, inputs, job_id="direct-1").id == first.id
    with pytest.raises(ClientConflict, match="409: job 'direct-1' already exists"):
        client.submit(PLAIN, {"IN": np.zeros((1,), dtype=np.int8)}, job_id="direct-1")
    with pytest.raises(ClientConflict):
        client.submit(PLAIN, inputs, job_id="direct-1", outputs=["OUT"])
    client.close()
    assert await redis.xlen(keys.request_stream(PLAIN)) == 1
