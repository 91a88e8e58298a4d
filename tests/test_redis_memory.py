"""Redis out of memory (maxmemory, noeviction): every write answers 503 / RESOURCE_EXHAUSTED at
once, nothing is left half-written, and the service serves again once Redis has room.

The service runs on a Redis of this module's own, which each test fills past a maxmemory set
just below what it holds (a ballast key), then empties again.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
from sluice.gateway.app import http_error
from sluice.gateway.grpc_app import grpc_status
from sluice.gateway.outbox import Route
from sluice.shared import keys
from sluice.shared.ensemble import CLIENT, build_plan
from sluice.shared.ensemble_wire import Continuation
from sluice.shared.errors import OutOfMemory, error_from_code
from sluice.shared.http_messages import HttpRequest
from sluice.shared.protocol import Request, Result, Tensor, decode_results
from sluice.shared.redis_client import OUT_OF_MEMORY, async_client, out_of_memory
from sluice.shared.registry import MEMBER_TTL_S, live_members, now_ms
from sluice.shared.repository_control import declare
from sluice.shared.when_full import past_maxmemory
from sluice.workers.answers.publisher import Publisher
from sluice.workers.answers.refused_results import REFUSED
from sluice.workers.batching.batcher import Pending
from sluice.workers.batching.pending import Queued
from tritonclient.utils import InferenceServerException

from sluice.embedded_redis import EmbeddedRedis, redis_server_binary
from tests.conftest import Service, start_service, stop_service, wait_until
from tests.grpc_calls import grpc_input
from tests.test_dispatcher import reading_dispatcher
from tests.test_ensemble_plan import INC, chain

BALLAST = "test:ballast"
BALLAST_BYTES = 16 << 20
NOT_QUEUED = f"{OUT_OF_MEMORY}: request not queued"


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as redis_server:
        yield redis_server


@pytest.fixture(scope="module")
def fleet(model_repo: Path, server: EmbeddedRedis) -> Iterator[tuple[Service, redis.Redis]]:
    args = ["--model-repository", str(model_repo), "--redis-url", server.url]
    service = start_service([*args, "--bulk-workers", "0"])
    client = redis.Redis.from_url(server.url)
    try:
        yield service, client
    finally:
        client.close()
        stop_service(service)


@contextlib.contextmanager
def redis_full(client: redis.Redis) -> Iterator[None]:
    """Redis over its maxmemory while inside (a ballast key past a limit set just above what
    it held before); room again, the ballast gone, afterwards."""
    client.config_set("maxmemory", 0)
    used = int(client.info("memory")["used_memory"])
    client.setrange(BALLAST, BALLAST_BYTES - 1, b"\0")  # built in Redis: no large command
    client.config_set("maxmemory", used + BALLAST_BYTES // 4)
    try:
        yield
    finally:
        client.delete(BALLAST)


def call(service: Service, method: str, path: str, body: Any = None) -> tuple[int, dict, dict]:
    host, port = service.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode())
        response = conn.getresponse()
        data = response.read()
        headers = {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()
    return response.status, json.loads(data) if data else {}, headers


def affine_body(value: float, job_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [value] * 4}]
    }
    if job_id is not None:
        body["id"] = job_id
    return body


def test_infer_is_refused_with_a_503_then_served_once_redis_has_room(
    fleet: tuple[Service, redis.Redis],
) -> None:
    service, client = fleet
    path = "/v2/models/affine/infer"
    # requests sent together share one stream entry: each gets the refusal
    with redis_full(client), ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda v: call(service, "POST", path, affine_body(v)), range(8)))
    for status, body, headers in answers:
        assert (status, body) == (503, {"error": NOT_QUEUED})
        assert headers["retry-after"] == "2"
    status, body, _ = call(service, "POST", path, affine_body(1.0))
    assert status == 200, body


async def test_a_full_redis_is_no_outage_and_leaves_no_waiter(
    fleet: tuple[Service, redis.Redis], server: EmbeddedRedis
) -> None:
    _, client = fleet
    async with reading_dispatcher(server.url, "gw-oom") as d:
        request = Request(d.new_request_id(), 1, 0, d.reply_stream, [])
        with redis_full(client), pytest.raises(OutOfMemory) as refused:
            await d.submit(Route("oom-model", max_per_entry=4), request, 30)
        assert refused.value.message == NOT_QUEUED
        assert (d.outage.since_s, len(d.outage.held)) == (None, 0)  # nothing held, nothing retried
        assert (d.waiting, d.unanswered()) == ({}, [])


def test_grpc_infer_is_resource_exhausted_then_served(fleet: tuple[Service, redis.Redis]) -> None:
    service, client = fleet
    grpc = grpcclient.InferenceServerClient(service.grpc_url)
    inputs = [grpc_input("X", np.ones((1, 4), np.float32), "FP32")]
    try:
        with redis_full(client), pytest.raises(InferenceServerException) as refused:
            grpc.infer("affine", inputs)
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert refused.value.message() == NOT_QUEUED
        assert grpc.infer("affine", inputs).as_numpy("Y") is not None
    finally:
        grpc.close()


def test_a_refused_job_leaves_no_job_behind(fleet: tuple[Service, redis.Redis]) -> None:
    service, client = fleet
    path = "/v2/models/affine/jobs"
    with redis_full(client):
        status, body, _ = call(service, "POST", path, affine_body(2.0, "oom-job-1"))
    assert (status, body) == (503, {"error": f"{OUT_OF_MEMORY}: job not created"})
    assert not client.exists(keys.job_stream("oom-job-1"))
    assert call(service, "GET", "/v2/jobs/oom-job-1")[0] == 404
    assert call(service, "POST", path, affine_body(2.0, "oom-job-1"))[0] == 202
    status, result, _ = call(service, "GET", "/v2/jobs/oom-job-1?wait=30")
    assert status == 200 and result["outputs"][0]["data"] == [5.0] * 4


def test_a_full_redis_leaves_the_fleet_alive_and_ready(fleet: tuple[Service, redis.Redis]) -> None:
    service, client = fleet
    with redis_full(client):
        start = now_ms()

        def beaten() -> bool:
            members, _ = live_members(client.hgetall(keys.FLEET), now_ms())
            late = start + MEMBER_TTL_S * 1000
            return {m.kind for m in members if m.heartbeat_ms > late} == {"gateway", "worker"}

        wait_until(beaten, "heartbeats past the member TTL while Redis is full")
        assert call(service, "GET", "/v2/health/ready")[0] == 200
        status, body, _ = call(service, "POST", "/v2/models/affine/infer", affine_body(1.0))
        assert (status, body) == (503, {"error": NOT_QUEUED})


def test_a_job_cancel_refused_for_memory_says_so(fleet: tuple[Service, redis.Redis]) -> None:
    service, client = fleet
    # batch8 waits up to a second to fill a batch: the job is still queued when cancelled
    job = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 4], "data": [1.0] * 4}]}
    assert call(service, "POST", "/v2/models/batch8/jobs", {**job, "id": "oom-cancel-1"})[0] == 202
    with redis_full(client):
        status, body, _ = call(service, "DELETE", "/v2/jobs/oom-cancel-1")
    assert (status, body) == (503, {"error": f"{OUT_OF_MEMORY}: job not cancelled"})


def test_a_refused_bulk_job_leaves_nothing_a_retry_would_find(
    fleet: tuple[Service, redis.Redis],
) -> None:
    service, client = fleet
    line = {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1.0] * 4}]}
    path = "/v2/models/affine/bulk?id=oom-bulk-1&format=jsonl"
    with redis_full(client):
        status, body, _ = call(service, "POST", path, line)
    assert status == 503 and body["error"].startswith(OUT_OF_MEMORY), body
    assert not client.keys("*oom-bulk-1*")
    status, body, _ = call(service, "POST", path, line)
    assert (status, body["status"]) == (202, "queued"), body


async def test_a_load_refused_for_memory_records_nothing(
    fleet: tuple[Service, redis.Redis], server: EmbeddedRedis
) -> None:
    _, client = fleet
    redis_async = async_client(server.url)
    try:
        before = client.get(keys.DESIRED_GENERATION)
        with redis_full(client), pytest.raises(redis.RedisError) as refused:
            await declare(redis_async, "affine", loaded=True, config_json='{"max_batch_size": 4}')
        assert out_of_memory(refused.value)  # Redis 6.2 words it as a script error
        assert client.get(keys.DESIRED_GENERATION) == before
        assert client.hget(keys.DESIRED, "affine") is None
    finally:
        await redis_async.aclose()
    # what a client of the load is answered, over either protocol
    gone = asyncio.get_running_loop().create_future()
    load = HttpRequest("POST", "/v2/repository/models/affine/load", {}, b"", gone)
    response = http_error(refused.value, load)
    assert response.status == 503
    assert json.loads(response.body) == {"error": f"{OUT_OF_MEMORY}: nothing was written"}
    assert grpc_status(refused.value) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"{OUT_OF_MEMORY}: nothing was written",
    )


async def publish_while_full(
    server: EmbeddedRedis,
    client: redis.Redis,
    model: str,
    requests: list[Request],
    results: list[Result],
) -> str:
    """`results` of `requests` (one stream entry of `model`'s, read by a worker) published
    while Redis is full; the entry's stream."""
    stream = keys.request_stream(model)
    client.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
    entry_id = client.xadd(stream, {"h": b"", "d": b""})
    client.xreadgroup(keys.WORKER_GROUP, "oom-worker", {stream: ">"})
    items = [Queued(request, stream, entry_id, Pending(1, 1, 0)) for request in requests]
    redis_async = async_client(server.url)
    publisher = Publisher(redis_async, model, set())
    publisher.hold(stream, entry_id, len(items))
    try:
        with redis_full(client):
            await publisher.publish(items, results)
    finally:
        await publisher.close()
        await redis_async.aclose()
    return stream


def answers_on(client: redis.Redis, reply_to: str) -> list[tuple[str, tuple[str, str] | None]]:
    return [(r.id, r.error) for _, f in client.xrange(reply_to) for r in decode_results(f)]


async def test_results_refused_for_memory_end_each_request_in_one_error(
    fleet: tuple[Service, redis.Redis], server: EmbeddedRedis
) -> None:
    _, client = fleet
    reply_to = keys.reply_stream("oom-gateway")
    requests = [Request(f"oom-{i}", 1, 0, reply_to, []) for i in range(3)]
    results = [Result(r.id) for r in requests]
    stream = await publish_while_full(server, client, "oom-model", requests, results)
    refused = ("RESOURCE_EXHAUSTED", REFUSED)
    assert answers_on(client, reply_to) == [(r.id, refused) for r in requests]
    assert client.xpending(stream, keys.WORKER_GROUP)["pending"] == 0
    # the gateway answers such a request as it answers one it could not queue
    error = error_from_code(*refused)
    assert (error.http_status, grpc_status(error)[0]) == (503, grpc.StatusCode.RESOURCE_EXHAUSTED)


async def test_an_ensemble_step_refused_for_memory_answers_its_request(
    fleet: tuple[Service, redis.Redis], server: EmbeddedRedis
) -> None:
    _, client = fleet
    plan = build_plan("chain", {"chain": chain(), "inc": INC})
    reply_to = keys.reply_stream("oom-gateway-2")
    cont = Continuation(plan, CLIENT, reply_to, None, (0, 0), 30_000)
    one = np.ones((1, 1), np.float32).tobytes()
    step = Request("oom-e", 1, 0, reply_to, [Tensor("X", "FP32", (1, 1), one)], None, {})
    step.continuation = cont.at(0).encode()
    done = Result(step.id, [Tensor("Y", "FP32", (1, 1), one)])
    stream = await publish_while_full(server, client, "inc", [step], [done])
    assert answers_on(client, reply_to) == [(step.id, ("RESOURCE_EXHAUSTED", REFUSED))]
    assert client.xlen(stream) == 0  # the next step was not queued; this one is acknowledged


def _binaries() -> list[str]:
    """The embedded redis-server, and the one on PATH where it is another (Redis 7 here)."""
    found = shutil.which("redis-server")
    return list(dict.fromkeys([redis_server_binary(), *([found] if found else [])]))


@pytest.mark.parametrize("binary", _binaries())
def test_a_full_redis_refuses_a_write_but_runs_it_past_maxmemory(binary: str) -> None:
    with EmbeddedRedis(binary=binary, maxmemory=1) as tiny:
        client = redis.Redis.from_url(tiny.url)
        try:
            with pytest.raises(redis.RedisError) as refused:
                client.hset("sluice:{t}:fleet", "w1", b"beat")
            assert out_of_memory(refused.value)
            client.execute_command(*past_maxmemory("HSET", "sluice:{t}:fleet", "w1", b"beat"))
            assert client.hget("sluice:{t}:fleet", "w1") == b"beat"
            assert not client.exists("sluice:{t}:fleet:never")
        finally:
            client.close()
