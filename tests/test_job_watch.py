"""The gateway's one subscription to job events: it wakes the waiters of the job announced,
holds at most its bound of them, and lets a waiter go as soon as its client leaves."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
from sluice.gateway.job_watch import JobWatch
from sluice.gateway.jobs import JobStore
from sluice.shared import keys
from sluice.shared.errors import Unavailable
from sluice.shared.protocol import Result, encode_results, job_event
from sluice.shared.redis_client import async_client, initialized

from sluice.embedded_redis import EmbeddedRedis

META = {"model": "m", "version": 1, "client_id": None, "outputs": None, "binary": False}


@pytest.fixture
async def redis(redis_server: EmbeddedRedis) -> AsyncIterator[Any]:
    client = async_client(redis_server.url, socket_timeout_s=None)
    await initialized(client)
    yield client
    await client.aclose()


@pytest.fixture
async def watch(redis: Any) -> AsyncIterator[JobWatch]:
    own = JobWatch(redis, max_waiters=2)
    task = asyncio.create_task(own.run())
    await own.listening.wait()
    yield own
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def queued_job(redis: Any) -> str:
    """A job queued that no worker answers."""
    job_id = f"watch-{uuid.uuid4().hex}"
    await redis.xadd(keys.job_stream(job_id), {"m": msgpack.packb(META)})
    return job_id


async def answer(redis: Any, job_id: str) -> None:
    """What a worker does: the result entry, then its announcement."""
    await redis.xadd(keys.job_stream(job_id), encode_results([Result(job_id)]))
    await redis.publish(keys.job_channel(job_id), job_event(job_id, "done"))


async def waiting(watch: JobWatch, count: int) -> None:
    while watch.count != count:
        await asyncio.sleep(0)


async def test_an_announcement_wakes_every_waiter_of_its_job(redis: Any, watch: JobWatch) -> None:
    jobs = JobStore(redis, watch, ttl_s=60)
    job_id, other = await queued_job(redis), await queued_job(redis)
    polls = [asyncio.create_task(jobs.get(job_id, wait_s=60)) for _ in range(2)]
    await waiting(watch, 2)
    await answer(redis, other)  # another job's announcement: these two read theirs again
    await answer(redis, job_id)
    for job in await asyncio.gather(*polls):
        assert job is not None and job.status == "done"
    assert watch.count == 0


async def test_waiters_are_bounded(redis: Any, watch: JobWatch) -> None:
    jobs = JobStore(redis, watch, ttl_s=60)
    job_id = await queued_job(redis)
    polls = [asyncio.create_task(jobs.get(job_id, wait_s=60)) for _ in range(2)]
    await waiting(watch, 2)
    with pytest.raises(Unavailable, match="too many requests wait for jobs"):
        await jobs.get(job_id, wait_s=60)
    assert (await jobs.get(job_id)) is not None  # a look without a wait is served
    await answer(redis, job_id)
    await asyncio.gather(*polls)


async def test_a_waiter_whose_client_leaves_is_let_go(redis: Any, watch: JobWatch) -> None:
    jobs = JobStore(redis, watch, ttl_s=60)
    job_id = await queued_job(redis)
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    poll = asyncio.create_task(jobs.get(job_id, wait_s=60, gone=gone))
    cancelled = asyncio.create_task(jobs.get(job_id, wait_s=60))
    await waiting(watch, 2)
    gone.set_result(None)
    job = await poll
    assert job is not None and job.status == "queued"
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    assert watch.count == 0
