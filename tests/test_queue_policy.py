"""Triton's queue policy end to end: priorities, queue size, timeouts; plus deadlines and
cancellation on client disconnect."""

from __future__ import annotations

import json
import socket
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest
import redis
import tritonclient.http as httpclient
from sluice.shared import keys
from tritonclient.utils import InferenceServerException

from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import Service, start_service, stop_service, wait_in_hub

MODEL = textwrap.dedent('''
    import os

    import redis


    class Model:
        """Records what it runs, then holds each batch until the test opens its gate."""

        def __init__(self, context):
            self.redis = redis.Redis.from_url(os.environ["GATE_REDIS_URL"])
            self.name = context.name

        def infer(self, inputs):
            self.redis.rpush(self.name + ":order", *inputs["IN"].flatten().tolist())
            self.redis.blpop(self.name + ":gate")
            return {"OUT": inputs["IN"] + 1}
''')

CONFIGS = {
    "prio": "priority_levels: 2 default_priority_level: 2",
    "bounded": "default_queue_policy { max_queue_size: 2 }",
    "timed": "default_queue_policy { default_timeout_microseconds: 10000000 "
    "allow_timeout_override: true }",
    "delayed": "default_queue_policy { default_timeout_microseconds: 10000000 "
    "allow_timeout_override: true timeout_action: DELAY }",
    "plain": "",
}


def _config(name: str, batching: str) -> str:
    return f"""
name: "{name}"
backend: "python"
max_batch_size: 1
input [ {{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
dynamic_batching {{ {batching} }}
"""


@pytest.fixture(scope="module")
def policy_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def policy_service(
    tmp_path_factory: pytest.TempPathFactory, policy_redis: EmbeddedRedis
) -> Iterator[Service]:
    repo = tmp_path_factory.mktemp("policy")
    for name, batching in CONFIGS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(_config(name, batching))
        (repo / name / "1" / "model.py").write_text(MODEL)
    service = start_service(
        ["--model-repository", str(repo), "--redis-url", policy_redis.url],
        env={"GATE_REDIS_URL": policy_redis.url},
    )
    yield service
    stop_service(service)


@pytest.fixture
def gate(policy_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(policy_redis.url)
    yield client
    client.close()


@pytest.fixture
def client(policy_service: Service) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(policy_service.http_url, concurrency=8)
    yield c
    c.close()


def _send(
    client: httpclient.InferenceServerClient,
    model: str,
    value: int,
    priority: int = 0,
    timeout: int | None = None,
    **params: int,
) -> httpclient.InferAsyncRequest:
    """tritonclient sends Triton's `priority` and `timeout` request parameters itself."""
    tensor = httpclient.InferInput("IN", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], np.int32))
    return client.async_infer(
        model, [tensor], priority=priority, timeout=timeout, parameters=params or None
    )


def _wait_running(gate: redis.Redis, model: str, value: int) -> None:
    """Until the model has started on `value` (it records it before holding)."""
    wait_in_hub(
        lambda: value in [int(v) for v in gate.lrange(f"{model}:order", 0, -1)],
        f"{model} running {value}",
    )


def _queued(gate: redis.Redis, model: str, count: int, level: int = 0) -> None:
    stream = keys.request_stream(model, level)
    wait_in_hub(lambda: gate.xlen(stream) >= count, f"{count} queued on {stream}")


def _value(request) -> int:
    return int(request.get_result().as_numpy("OUT")[0, 0])


def test_higher_priority_runs_first(client, gate: redis.Redis) -> None:
    first = _send(client, "prio", 1)  # default level 2
    _wait_running(gate, "prio", 1)
    low = _send(client, "prio", 2, priority=2)
    _queued(gate, "prio", 1, level=2)
    high = _send(client, "prio", 3, priority=1)
    _queued(gate, "prio", 1, level=1)
    gate.rpush("prio:gate", 1, 2, 3)
    assert [_value(r) for r in (first, low, high)] == [2, 3, 4]
    assert [int(v) for v in gate.lrange("prio:order", 0, -1)] == [1, 3, 2]


def test_max_queue_size_rejects_with_503(client, gate: redis.Redis) -> None:
    first = _send(client, "bounded", 1)
    _wait_running(gate, "bounded", 1)
    second, third = _send(client, "bounded", 2), _send(client, "bounded", 3)
    with pytest.raises(InferenceServerException) as err:
        third.get_result()
    assert err.value.status() == "503"
    assert "Exceeds maximum queue size" in err.value.message()
    gate.rpush("bounded:gate", 1, 2)
    assert [_value(first), _value(second)] == [2, 3]


def test_timeout_override_rejects_a_request_that_waited_too_long(client, gate) -> None:
    first = _send(client, "timed", 1)
    _wait_running(gate, "timed", 1)
    late = _send(client, "timed", 2, timeout=1)  # 1 µs: expired by the time it is read
    on_time = _send(client, "timed", 3)
    _queued(gate, "timed", 3)
    gate.rpush("timed:gate", 1, 3)
    with pytest.raises(InferenceServerException) as err:
        late.get_result()
    assert err.value.status() == "503"
    assert "Request timeout expired" in err.value.message()
    assert [_value(first), _value(on_time)] == [2, 4]
    assert 2 not in [int(v) for v in gate.lrange("timed:order", 0, -1)]


def test_delay_action_still_runs_the_request(client, gate: redis.Redis) -> None:
    first = _send(client, "delayed", 1)
    _wait_running(gate, "delayed", 1)
    late = _send(client, "delayed", 2, timeout=1)
    gate.rpush("delayed:gate", 1, 2)
    assert [_value(first), _value(late)] == [2, 3]


def test_deadline_covers_the_whole_request_without_a_server_default(client, gate) -> None:
    first = _send(client, "plain", 1)
    _wait_running(gate, "plain", 1)
    hurried = _send(client, "plain", 2, deadline_us=1)
    with pytest.raises(InferenceServerException) as err:
        hurried.get_result()
    assert err.value.status() == "503"
    assert "Request deadline exceeded" in err.value.message()
    patient = _send(client, "plain", 3)
    _queued(gate, "plain", 3)
    gate.rpush("plain:gate", 1, 3)
    assert [_value(first), _value(patient)] == [2, 4]
    assert 2 not in [int(v) for v in gate.lrange("plain:order", 0, -1)]


def test_a_request_whose_client_left_is_not_computed(
    client, gate: redis.Redis, policy_service: Service
) -> None:
    first = _send(client, "prio", 10)
    _wait_running(gate, "prio", 10)
    cancels = gate.pubsub()
    cancels.subscribe(keys.cancel_channel("prio"))
    host, port = policy_service.http_url.split(":")
    body = json.dumps(
        {"inputs": [{"name": "IN", "shape": [1, 1], "datatype": "INT32", "data": [11]}]}
    ).encode()
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(
            b"POST /v2/models/prio/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        _queued(gate, "prio", 1, level=2)
    message = None
    while message is None or message["type"] != "message":
        message = cancels.get_message(timeout=10)
    cancels.close()
    after = _send(client, "prio", 12)
    gate.rpush("prio:gate", 10, 12)
    assert [_value(first), _value(after)] == [11, 13]
    assert 11 not in [int(v) for v in gate.lrange("prio:order", 0, -1)]
    stats = client.get_inference_statistics("prio")["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] >= 1
