"""Riding through Redis outages: the gateway holds requests and sends them (again) once Redis is
back; a worker keeps finished results until it can publish them. Real redis-servers on fixed
ports, killed and restarted by the tests; the tests play the other side of the streams."""

from __future__ import annotations

import asyncio
import http.client
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import orjson
import pytest
import redis.asyncio as aioredis
from sluice.gateway.dispatcher import Dispatcher
from sluice.gateway.outage import RETRY_AFTER_S, OutagePolicy
from sluice.gateway.outbox import Route
from sluice.shared import keys
from sluice.shared.errors import Unavailable
from sluice.shared.protocol import (
    Request,
    Result,
    Tensor,
    decode_requests,
    decode_results,
    encode_results,
)
from sluice.shared.redis_client import async_client
from sluice.workers.answers.publisher import Publisher
from sluice.workers.batching.pending import Queued

from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import free_port, needs_single_redis, start_service, stop_service, wait_until
from tests.test_dispatcher import reading_dispatcher

pytestmark = needs_single_redis

GRACE_S = 15.0


class Clock:
    """The dispatcher's clock, moved by the test; `reads` counts its readings (each retry
    round while Redis is away takes one)."""

    def __init__(self) -> None:
        self.now_s = 1000.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now_s


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A Redis on a fixed port without persistence: a restart comes back empty."""
    with EmbeddedRedis(port=free_port()) as redis_server:
        yield redis_server


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def dispatcher(server: EmbeddedRedis, clock: Clock) -> AsyncIterator[Dispatcher]:
    policy = OutagePolicy(GRACE_S, max_held_bytes=64)
    async with reading_dispatcher(server.url, "gw-outage", outage=policy, clock_s=clock) as d:
        yield d


def _request(d: Dispatcher, size: int = 4) -> Request:
    return Request(
        d.new_request_id(), 1, 0, d.reply_stream, [Tensor("IN", "INT8", (size,), b"\x01" * size)]
    )


async def _until(condition: object, what: str) -> None:
    """Let the dispatcher's tasks run until `condition` (state in this process) holds."""
    for _ in range(2000):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


async def _queued_ids(url: str, model: str) -> list[str]:
    client = async_client(url)
    try:
        entries = await client.xrange(keys.request_stream(model))
    finally:
        await client.aclose()
    return [r.id for _, fields in entries for r in decode_requests(fields)]


async def _until_queued(url: str, model: str, ids: list[str]) -> None:
    for _ in range(2000):
        if sorted(await _queued_ids(url, model)) == sorted(ids):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {ids} in the stream")


async def _answer(url: str, d: Dispatcher, *ids: str, entry_id: str = "*") -> None:
    client = async_client(url)
    try:
        await client.xadd(d.reply_stream, encode_results([Result(i) for i in ids]), id=entry_id)
    finally:
        await client.aclose()


async def test_a_request_sent_while_redis_is_down_is_sent_when_it_is_back(
    server: EmbeddedRedis, dispatcher: Dispatcher
) -> None:
    await _until(lambda: dispatcher.outage.server is not None, "the reader to learn the server")
    server.kill()
    request = _request(dispatcher)
    waiting = asyncio.create_task(dispatcher.submit(Route("m"), request, 60))
    await _until(lambda: len(dispatcher.outage.held) == 1, "the request to be held")
    assert not waiting.done()
    server.start()
    await _until(lambda: dispatcher.outage.since_s is None, "the outage to end")
    assert await _queued_ids(server.url, "m") == [request.id]
    await _answer(server.url, dispatcher, request.id)
    assert (await asyncio.wait_for(waiting, 30)).id == request.id


async def test_requests_waiting_through_a_restart_that_lost_them_are_sent_again(
    server: EmbeddedRedis, dispatcher: Dispatcher
) -> None:
    await _until(lambda: dispatcher.outage.server is not None, "the reader to learn the server")
    answered_first = _request(dispatcher)
    first = asyncio.create_task(dispatcher.submit(Route("m"), answered_first, 60))
    await _until_queued(server.url, "m", [answered_first.id])
    await _answer(server.url, dispatcher, answered_first.id)
    await asyncio.wait_for(first, 30)  # the reader has read past this reply's id
    requests = [_request(dispatcher) for _ in range(3)]
    waiting = [asyncio.create_task(dispatcher.submit(Route("m"), r, 60)) for r in requests]
    await _until_queued(server.url, "m", [answered_first.id, *(r.id for r in requests)])
    server.kill()
    server.start()  # empty: no persistence
    await _until_queued(server.url, "m", [r.id for r in requests])  # sent again
    # the new server's ids may sort before the last one read (another host's clock): read
    # from the start; a request that ran twice (its entry survived and was sent again)
    # resolves once
    await _answer(server.url, dispatcher, *(r.id for r in requests), entry_id="1-0")
    await _answer(server.url, dispatcher, requests[0].id)
    results = await asyncio.wait_for(asyncio.gather(*waiting), 30)
    assert [r.id for r in results] == [r.id for r in requests]
    assert dispatcher.waiting == {}


async def test_a_request_held_past_the_grace_gets_503_with_retry_after(
    server: EmbeddedRedis, dispatcher: Dispatcher, clock: Clock
) -> None:
    await _until(lambda: dispatcher.outage.server is not None, "the reader to learn the server")
    sent_before = asyncio.create_task(dispatcher.submit(Route("m"), _request(dispatcher), 60))
    await _until(lambda: dispatcher.inflight["m:1"] == 1, "the first request to be queued")
    await _until_queued(server.url, "m", list(dispatcher.waiting))
    server.kill()
    held = asyncio.create_task(dispatcher.submit(Route("m"), _request(dispatcher), 60))
    await _until(lambda: len(dispatcher.outage.held) == 1, "the request to be held")
    clock.now_s += GRACE_S - 1
    reads = clock.reads
    await _until(lambda: clock.reads >= reads + 2, "a retry round to pass")
    assert not held.done() and not sent_before.done()
    clock.now_s += 1
    for task in (held, sent_before):
        with pytest.raises(Unavailable) as error:
            await asyncio.wait_for(task, 30)
        assert error.value.retry_after_s == RETRY_AFTER_S
        assert "--redis-outage-grace-s" in error.value.message
    assert dispatcher.waiting == {}


async def test_requests_beyond_the_held_bytes_cap_get_503_at_once(
    server: EmbeddedRedis, dispatcher: Dispatcher
) -> None:
    server.kill()
    first = asyncio.create_task(dispatcher.submit(Route("m"), _request(dispatcher, 40), 60))
    await _until(lambda: len(dispatcher.outage.held) == 1, "the first request to be held")
    with pytest.raises(Unavailable) as error:
        await asyncio.wait_for(dispatcher.submit(Route("m"), _request(dispatcher, 40), 60), 30)
    assert error.value.retry_after_s == RETRY_AFTER_S
    assert "--max-held-bytes" in error.value.message
    small = asyncio.create_task(dispatcher.submit(Route("m"), _request(dispatcher, 24), 60))
    await _until(lambda: len(dispatcher.outage.held) == 2, "a request within the cap to be held")
    assert not first.done() and not small.done()
    server.start()
    await _until(lambda: dispatcher.outage.since_s is None, "the outage to end")
    ids = await _queued_ids(server.url, "m")
    await _answer(server.url, dispatcher, *ids)
    assert len(await asyncio.wait_for(asyncio.gather(first, small), 30)) == 2


# -- the worker's side ---------------------------------------------------------------


@pytest.fixture
def persistent_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(port=free_port(), persistent=True) as redis_server:
        yield redis_server


async def test_results_finished_while_redis_is_down_are_published_when_it_is_back(
    persistent_server: EmbeddedRedis,
) -> None:
    url = persistent_server.url
    client: aioredis.Redis = async_client(url)
    stream = keys.request_stream("m")
    await client.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
    request = Request("gw:1", 1, 0, keys.reply_stream("gw"), [])
    entry_id = await client.xadd(stream, {"h": b"-", "d": b""})
    await client.xreadgroup(keys.WORKER_GROUP, "w1", {stream: ">"})
    await client.aclose()
    publisher = Publisher(async_client(url), "m", set())
    publisher.hold(stream, entry_id, 1)
    item = Queued(request, stream, entry_id, None, 0, 0)  # type: ignore[arg-type]
    persistent_server.kill()
    publishing = asyncio.create_task(publisher.publish([item], [Result(request.id)]))
    await _until(lambda: publisher.unacked, "the publish to meet the outage")
    assert publisher.held(stream) == [entry_id]  # still kept alive against takeover
    persistent_server.start()
    await asyncio.wait_for(publishing, 30)
    assert not publisher.unacked
    client = async_client(url)
    try:
        replies = await client.xrange(keys.reply_stream("gw"))
        assert [r.id for _, f in replies for r in decode_results(f)] == [request.id]
        pending = await client.xpending(stream, keys.WORKER_GROUP)
        assert pending["pending"] == 0  # acknowledged
    finally:
        await client.aclose()
        await publisher.close()
        await publisher.redis.aclose()


# -- end to end: what a client sees --------------------------------------------------


def _post(address: str, rows: int, action: str = "infer") -> http.client.HTTPResponse:
    body = {
        "inputs": [{"name": "X", "shape": [rows, 4], "datatype": "FP32", "data": [0.5] * rows * 4}]
    }
    connection = http.client.HTTPConnection(*address.split(":"), timeout=60)
    connection.request("POST", f"/v2/models/affine/{action}", orjson.dumps(body))
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


def test_clients_get_503_with_retry_after_past_the_grace_or_the_cap(
    model_repo: Path, server: EmbeddedRedis
) -> None:
    service = start_service(
        [
            *("--model-repository", str(model_repo), "--redis-url", server.url),
            *("--bulk-workers", "0", "--redis-outage-grace-s", "1", "--max-held-bytes", "100"),
        ]
    )
    try:
        assert _post(service.http_url, 1).status == 200
        server.kill()
        for rows in (8, 1):  # 128 bytes: over the cap at once; 16 bytes: held for the grace
            response = _post(service.http_url, rows)
            assert response.status == 503
            assert response.getheader("Retry-After") == str(RETRY_AFTER_S)
        job = _post(service.http_url, 1, "jobs")  # a job is queued at once or refused
        assert (job.status, job.getheader("Retry-After")) == (503, str(RETRY_AFTER_S))
        connection = http.client.HTTPConnection(*service.http_url.split(":"), timeout=60)
        connection.request("GET", "/v2/fleet")  # read from Redis alone
        fleet = connection.getresponse()
        assert (fleet.status, fleet.getheader("Retry-After")) == (503, str(RETRY_AFTER_S))
        connection.close()
        server.start()
        wait_until(lambda: _post(service.http_url, 1).status == 200, "service to resume")
    finally:
        stop_service(service)
