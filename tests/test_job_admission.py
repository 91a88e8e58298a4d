"""Jobs pass the same `max_queue_size` admission as infer requests, and the counter stays exact.

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
from sluice.shared.errors import Unavailable
from sluice.shared.protocol import Request, Result, Tensor, decode_requests, decode_results
from sluice.shared.redis_client import async_client
from sluice.shared.registry import encode_model_record
from sluice.workers.batcher import Pending
from sluice.workers.pending import Queued
from sluice.workers.publisher import Publisher

from sluice.client import RedisClient
from sluice.client.errors import Unavailable as ClientUnavailable

MODEL = "bounded"
ROUTE = Route(MODEL, level=0, max_queue_size=3)
META = {"model": MODEL, "version": 1, "client_id": None, "outputs": None, "binary": False}


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
    assert await jobs.submit(_job("job-1"), ROUTE, META)
    assert await jobs.submit(_job("job-2"), ROUTE, META)
    while await _queued(redis) < 3:  # the infer goes out on the loop's next turn
        await asyncio.sleep(0)
    assert await _counter(redis) == await _queued(redis) == 3

    with pytest.raises(Unavailable, match=r"\[request id: job-3\] Exceeds maximum queue size"):
        await jobs.submit(_job("job-3"), ROUTE, META)
    assert not await redis.exists(keys.job_stream("job-3"))  # free to submit again later
    assert await _counter(redis) == await _queued(redis) == 3

    answered = await _answer_everything(redis)
    assert sorted(answered) == sorted([request.id, "job-1", "job-2"])
    assert await _counter(redis) == await _queued(redis) == 0
    ((_, reply),) = await redis.xrange(dispatcher.reply_stream)
    assert [result.id for result in decode_results(reply)] == [request.id]
    assert await redis.xlen(keys.job_stream("job-1")) == 2  # metadata, then the result

    assert await jobs.submit(_job("job-3"), ROUTE, META)  # room again
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
