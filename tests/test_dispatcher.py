"""The gateway's dispatcher against a real Redis, with the test playing the worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from sluice.gateway.dispatcher import Dispatcher
from sluice.gateway.outbox import Route
from sluice.shared import keys
from sluice.shared.errors import Cancelled, InvalidInput, SluiceError, Unavailable
from sluice.shared.protocol import Request, Result, Tensor, decode_requests, encode_results
from sluice.shared.redis_client import async_client

#: how long a dispatcher's teardown may take.
TEARDOWN_S = 30


@contextlib.asynccontextmanager
async def reading_dispatcher(
    url: str, gateway_id: str, **options: Any
) -> AsyncIterator[Dispatcher]:
    """A dispatcher on `url` with its reply reader running, for the block."""
    redis = async_client(url)
    reader = async_client(url, socket_timeout_s=None)
    d = Dispatcher(redis, reader, gateway_id, **options)
    task = asyncio.create_task(d.replies.run())
    try:
        yield d
    finally:
        task.cancel()
        # bounded: a connection torn down mid-read must not hold the test run
        async with asyncio.timeout(TEARDOWN_S):
            await asyncio.gather(task, return_exceptions=True)
            await d.close()
            await redis.aclose()
            await reader.aclose()


@pytest.fixture
async def dispatcher(redis_url: str) -> AsyncIterator[Dispatcher]:
    async with reading_dispatcher(redis_url, "gw-test") as d:
        yield d


def _request(d: Dispatcher) -> Request:
    return Request(d.new_request_id(), 1, 0, d.reply_stream, [Tensor("IN", "INT8", (1,), b"\x01")])


async def _entries(redis: aioredis.Redis, model: str, count: int) -> list[list[Request]]:
    stream = keys.request_stream(model)
    while await redis.xlen(stream) < count:
        await asyncio.sleep(0)
    return [decode_requests(fields) for _, fields in await redis.xrange(stream)]


async def _answer(redis: aioredis.Redis, d: Dispatcher, *ids: str) -> None:
    await redis.xadd(d.reply_stream, encode_results([Result(i) for i in ids]))


async def test_requests_of_one_loop_turn_share_one_entry(dispatcher: Dispatcher) -> None:
    requests = [_request(dispatcher) for _ in range(10)]
    waits = [
        asyncio.create_task(dispatcher.submit(Route("m", max_per_entry=4), r, 30)) for r in requests
    ]
    entries = await _entries(dispatcher.redis, "m", 3)
    assert [len(e) for e in entries] == [4, 4, 2]  # at most max_batch_size requests an entry
    assert [r.id for e in entries for r in e] == [r.id for r in requests]
    await _answer(dispatcher.redis, dispatcher, *(r.id for r in reversed(requests)))
    results = await asyncio.gather(*waits)
    assert [r.id for r in results] == [r.id for r in requests]
    assert dispatcher.inflight_snapshot() == {}


async def test_preserve_ordering_holds_a_later_result_back(dispatcher: Dispatcher) -> None:
    first, second = _request(dispatcher), _request(dispatcher)
    done: list[str] = []

    async def submit(request: Request) -> None:
        await dispatcher.submit(Route("ordered"), request, 30, preserve_ordering=True)
        done.append(request.id)

    tasks = [asyncio.create_task(submit(first)), asyncio.create_task(submit(second))]
    await _entries(dispatcher.redis, "ordered", 1)
    await _answer(dispatcher.redis, dispatcher, second.id)
    while second.id in dispatcher.waiting:  # its result has arrived...
        await asyncio.sleep(0)
    assert done == []  # ...but it waits for the first one
    await _answer(dispatcher.redis, dispatcher, first.id)
    await asyncio.gather(*tasks)
    assert done == [first.id, second.id]


async def test_no_result_in_time_is_a_503(dispatcher: Dispatcher) -> None:
    with pytest.raises(Unavailable, match="Request timeout expired"):
        await dispatcher.submit(Route("m"), _request(dispatcher), 0.05)
    assert dispatcher.waiting == {}


async def test_unreachable_redis_fails_fast_with_503() -> None:
    redis = async_client("redis://127.0.0.1:1/0")
    d = Dispatcher(redis, redis, "gw-down")
    with pytest.raises(Unavailable, match="queue unavailable"):
        await d.submit(Route("m"), _request(d), 30)
    await d.close()
    await redis.aclose()


async def test_max_queue_size_refuses_what_does_not_fit(dispatcher: Dispatcher) -> None:
    route = Route("bounded", level=2, max_queue_size=3)
    requests = [_request(dispatcher) for _ in range(5)]
    waits = [asyncio.create_task(dispatcher.submit(route, r, 30)) for r in requests]
    await _entries(dispatcher.redis, "bounded", 0)
    done, _ = await asyncio.wait(waits[3:])
    for task in done:
        with pytest.raises(Unavailable, match="Exceeds maximum queue size"):
            task.result()
    stream = keys.request_stream("bounded", 2)
    assert await dispatcher.redis.xlen(stream) == 3  # one entry per admitted request
    assert await dispatcher.redis.hget(keys.queue_sizes("bounded"), "2") == b"3"
    await _answer(dispatcher.redis, dispatcher, *(r.id for r in requests[:3]))
    assert [r.id for r in await asyncio.gather(*waits[:3])] == [r.id for r in requests[:3]]


async def test_cancel_publishes_the_request_id(dispatcher: Dispatcher, redis_url: str) -> None:
    listener = async_client(redis_url, socket_timeout_s=None).pubsub()
    await listener.subscribe(keys.cancel_channel("m"))
    await listener.get_message(timeout=5)  # the subscribe confirmation
    request = _request(dispatcher)
    wait = asyncio.create_task(dispatcher.submit(Route("m"), request, 30))
    await _entries(dispatcher.redis, "m", 1)
    dispatcher.cancel("m", request.id)
    with pytest.raises(Cancelled):
        await wait
    message = await listener.get_message(ignore_subscribe_messages=True, timeout=5)
    assert message is not None and message["data"] == request.id.encode()
    await listener.aclose()


async def test_it_polls_with_one_request_in_flight_and_not_with_more(redis_url: str) -> None:
    redis = async_client(redis_url)
    reader = async_client(redis_url, socket_timeout_s=None)
    d = Dispatcher(redis, reader, "gw-poll", idle_poll_us=600_000_000)
    replies = asyncio.create_task(d.replies.run())
    first = asyncio.create_task(d.submit(Route("polled"), _request(d), 30))
    await _entries(redis, "polled", 1)
    assert d.idle_poll.polling  # one request in flight: the reply is all it waits for
    second = asyncio.create_task(d.submit(Route("polled"), _request(d), 30))
    await _entries(redis, "polled", 2)
    await asyncio.sleep(0)
    assert not d.idle_poll.polling  # two in flight: the loop sleeps when it has nothing to do
    second_id = list(d.waiting)[1]
    await _answer(redis, d, second_id)
    await second
    assert not d.idle_poll.polling
    await _answer(redis, d, *d.waiting)
    await first
    assert d.idle_poll.polling  # the last one answered: polls for the client's next request
    await d.close()
    await asyncio.sleep(0)
    assert not d.idle_poll.polling  # closed: polling ends at the next turn
    replies.cancel()
    await asyncio.gather(replies, return_exceptions=True)
    await redis.aclose()
    await reader.aclose()


async def test_abandoning_a_model_fails_only_its_waiting_requests(dispatcher: Dispatcher) -> None:
    """A model unloaded everywhere after its requests were sent: they fail with the error at
    once (no worker will read them), while another model's request still gets its result."""
    gone, kept = _request(dispatcher), _request(dispatcher)
    lost = asyncio.create_task(dispatcher.submit(Route("unloaded"), gone, 30))
    served = asyncio.create_task(dispatcher.submit(Route("served"), kept, 30))
    await _entries(dispatcher.redis, "unloaded", 1)
    await _entries(dispatcher.redis, "served", 1)
    dispatcher.abandon("unloaded", Unavailable("gone for good"))
    with pytest.raises(Unavailable, match="gone for good"):
        await lost
    assert not served.done()
    await _answer(dispatcher.redis, dispatcher, kept.id)
    assert (await served).id == kept.id
    assert dispatcher.inflight_snapshot() == {}


async def test_a_request_that_cannot_be_encoded_fails_alone(dispatcher: Dispatcher) -> None:
    """A parameter msgpack cannot carry (an integer past 64 bits) fails its own request; the
    requests queued in the same turn, and every later one, still go out."""
    bad, good = _request(dispatcher), _request(dispatcher)
    bad.parameters["huge"] = 2**70
    failing = asyncio.create_task(dispatcher.submit(Route("m"), bad, 30))
    served = asyncio.create_task(dispatcher.submit(Route("m"), good, 30))
    with pytest.raises(InvalidInput, match="huge"):
        await failing
    entries = await _entries(dispatcher.redis, "m", 1)
    assert [r.id for e in entries for r in e] == [good.id]
    later = _request(dispatcher)
    waiting = asyncio.create_task(dispatcher.submit(Route("m"), later, 30))
    await _entries(dispatcher.redis, "m", 2)
    await _answer(dispatcher.redis, dispatcher, good.id, later.id)
    assert [r.id for r in await asyncio.gather(served, waiting)] == [good.id, later.id]


async def test_a_send_that_fails_unexpectedly_fails_its_requests_not_the_gateway(
    dispatcher: Dispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever breaks one send, its requests end with an error and later ones go out."""
    execute = dispatcher._sends.execute
    calls = 0

    async def broken_once(*commands: Any, **options: Any) -> list[Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        return await execute(*commands, **options)

    monkeypatch.setattr(dispatcher._sends, "execute", broken_once)
    with pytest.raises(SluiceError, match="request not queued: RuntimeError"):
        await dispatcher.submit(Route("m"), _request(dispatcher), 30)
    later = _request(dispatcher)
    waiting = asyncio.create_task(dispatcher.submit(Route("m"), later, 30))
    await _entries(dispatcher.redis, "m", 1)
    await _answer(dispatcher.redis, dispatcher, later.id)
    assert (await waiting).id == later.id
