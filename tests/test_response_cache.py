"""Triton's response cache across a fleet: one worker, two gateways sharing the Redis cache
and one with a local cache of its own.

A response computed for a request at one gateway answers the same tensors at the other, over
another protocol, without the model running again; Triton's statistics (cache_hit, cache_miss,
success, inference_count) and nv_cache_* metrics count it as Triton counts it.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from sluice.shared.redis_client import sync_client

from tests.conftest import Service, start_sluice, stop_service, wait_until
from tests.streams import start_worker

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
dynamic_batching {{ }}
input [ {{ name: "IN", data_type: TYPE_INT32, dims: [ 4 ] }} ]
output [
  {{ name: "DOUBLE", data_type: TYPE_INT32, dims: [ 4 ] }},
  {{ name: "NEGATED", data_type: TYPE_INT32, dims: [ 4 ] }}
]
{cache}
"""

ENSEMBLE = """
name: "doubled_twice"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 4 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 4 ] } ]
response_cache { enable: true }
ensemble_scheduling {
  step [
    {
      model_name: "uncached"
      model_version: -1
      input_map { key: "IN", value: "IN" }
      output_map { key: "DOUBLE", value: "TWICE" }
    },
    {
      model_name: "uncached"
      model_version: -1
      input_map { key: "IN", value: "TWICE" }
      output_map { key: "DOUBLE", value: "OUT" }
    }
  ]
}
"""

MODEL = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        """IN doubled and negated; a negative first element is the model's error."""

        def execute(self, requests):
            responses = []
            for request in requests:
                x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
                if x[0, 0] < 0:
                    error = pb_utils.TritonError("negative input")
                    responses.append(pb_utils.InferenceResponse(error=error))
                    continue
                responses.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("DOUBLE", x * 2), pb_utils.Tensor("NEGATED", -x)
                ]))
            return responses
''')

CACHE = "response_cache { enable: true }"
DECOUPLED = "response_cache { enable: true }\nmodel_transaction_policy { decoupled: true }"


def _model(root: Path, name: str, extra: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, cache=extra))
    (root / name / "1" / "model.py").write_text(MODEL)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, scratch_redis: Any) -> Iterator[list[Service]]:
    """Gateways 0 and 1 share the fleet's Redis cache; gateway 2 keeps a local one."""
    root = tmp_path_factory.mktemp("cache_repo")
    _model(root, "cached", CACHE)
    _model(root, "uncached", "")
    _model(root, "cached_decoupled", DECOUPLED)
    (root / "doubled_twice" / "1").mkdir(parents=True)
    (root / "doubled_twice" / "config.pbtxt").write_text(ENSEMBLE)
    url = scratch_redis.url
    sync_client(url).flushall()
    worker = start_worker(root, url)
    gateways: list[Service] = []
    try:
        for cache in ("redis", "redis", "local,size=4096"):
            gateways.append(start_sluice("gateway", ["--redis-url", url, "--cache-config", cache]))
        wait_until(lambda: _ready(gateways[0], "cached"), "the worker to load the models")
        yield gateways
    finally:
        for gateway in gateways:
            stop_service(gateway)
        worker.terminate()
        worker.wait(30)
        sync_client(url).flushall()


def _ready(gateway: Service, model: str) -> bool:
    try:
        urllib.request.urlopen(f"http://{gateway.http_url}/v2/models/{model}/ready", timeout=5)
    except (urllib.error.URLError, OSError):
        return False
    return True


def _http(gateway: Service, model: str, values: list[int]) -> dict[str, list[int]]:
    client = httpclient.InferenceServerClient(gateway.http_url)
    tensor = httpclient.InferInput("IN", [1, 4], "INT32")
    tensor.set_data_from_numpy(np.array([values], dtype=np.int32))
    result = client.infer(model, [tensor])
    return {
        o["name"]: result.as_numpy(o["name"]).tolist() for o in result.get_response()["outputs"]
    }


def _grpc(gateway: Service, model: str, values: list[int]) -> dict[str, list[int]]:
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    tensor = grpcclient.InferInput("IN", [1, 4], "INT32")
    tensor.set_data_from_numpy(np.array([values], dtype=np.int32))
    result = client.infer(model, [tensor])
    names = [o.name for o in result.get_response().outputs]
    return {name: result.as_numpy(name).tolist() for name in names}


def _json(gateway: Service, model: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://{gateway.http_url}/v2/models/{model}/infer", json.dumps(body).encode()
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _stats(gateway: Service, model: str) -> dict[str, int]:
    """The counts of the model's statistics that a cache changes."""
    url = f"http://{gateway.http_url}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=10) as reply:
        stats = json.loads(reply.read())["model_stats"][0]
    counts = {name: value["count"] for name, value in stats["inference_stats"].items()}
    return {
        "inference_count": stats["inference_count"],
        "execution_count": stats["execution_count"],
        **{k: counts[k] for k in ("success", "fail", "queue", "cache_hit", "cache_miss")},
    }


def _metric(gateway: Service, line_start: str) -> str | None:
    with urllib.request.urlopen(f"http://{gateway.metrics_url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return next((line for line in text.splitlines() if line.startswith(line_start)), None)


def test_a_response_computed_behind_one_gateway_answers_at_another(fleet: list[Service]) -> None:
    first, second, _ = fleet
    computed = _http(first, "cached", [1, 2, 3, 4])
    assert computed == {"DOUBLE": [[2, 4, 6, 8]], "NEGATED": [[-1, -2, -3, -4]]}
    # the same tensors at the other gateway, over gRPC: answered from the cache
    assert _grpc(second, "cached", [1, 2, 3, 4]) == computed
    # and as JSON, at the first: the same entry (the tensors decide it, not their encoding)
    body = {"inputs": [{"name": "IN", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    status, answer = _json(first, "cached", body)
    assert status == 200
    assert {o["name"]: o["data"] for o in answer["outputs"]} == {
        "DOUBLE": [2, 4, 6, 8],
        "NEGATED": [-1, -2, -3, -4],
    }
    expected = {
        "inference_count": 1,
        "execution_count": 1,
        "success": 3,
        "fail": 0,
        "queue": 3,
        "cache_hit": 2,
        "cache_miss": 1,
    }
    # each gateway writes its own hits before it reads; the other's arrive just after theirs
    wait_until(lambda: _stats(second, "cached") == expected, "both gateways' cache figures")
    assert _stats(first, "cached") == expected
    prefix = 'nv_cache_num_hits_per_model{model="cached",version="1"} '
    assert _metric(second, prefix) == prefix + "2"
    prefix = 'nv_cache_num_misses_per_model{model="cached",version="1"} '
    assert _metric(first, prefix) == prefix + "1"
    # a model that does not enable the cache runs every request, and has no cache series
    assert _http(first, "uncached", [5, 5, 5, 5]) == _http(second, "uncached", [5, 5, 5, 5])
    wait_until(lambda: _stats(first, "uncached")["inference_count"] == 2, "both runs")
    assert _stats(first, "uncached")["cache_hit"] == 0
    assert _metric(first, 'nv_cache_num_hits_per_model{model="uncached"') is None


def test_the_outputs_asked_for_are_part_of_the_key(fleet: list[Service]) -> None:
    first, second, _ = fleet
    tensor = {"name": "IN", "datatype": "INT32", "shape": [1, 4], "data": [7, 7, 7, 7]}
    status, one = _json(first, "cached", {"inputs": [tensor], "outputs": [{"name": "NEGATED"}]})
    assert status == 200
    assert [o["name"] for o in one["outputs"]] == ["NEGATED"]
    status, both = _json(second, "cached", {"inputs": [tensor]})
    assert status == 200
    assert sorted(o["name"] for o in both["outputs"]) == ["DOUBLE", "NEGATED"]


def test_a_failed_request_is_not_cached(fleet: list[Service]) -> None:
    first, second, _ = fleet
    tensor = {"name": "IN", "datatype": "INT32", "shape": [1, 4], "data": [-1, 0, 0, 0]}
    before = _stats(first, "cached")
    for gateway in (first, second):
        status, answer = _json(gateway, "cached", {"inputs": [tensor]})
        assert status == 500
        assert "negative input" in answer["error"]
    # the model ran both (Triton counts a model's own error response as a success)
    wait_until(
        lambda: _stats(first, "cached")["inference_count"] == before["inference_count"] + 2,
        "both runs",
    )
    assert _stats(second, "cached")["cache_hit"] == before["cache_hit"]


def test_a_local_cache_serves_its_own_gateway(fleet: list[Service]) -> None:
    local = fleet[2]
    before = _stats(local, "cached")
    assert _http(local, "cached", [9, 8, 7, 6]) == _http(local, "cached", [9, 8, 7, 6])
    after = _stats(local, "cached")
    assert after["cache_hit"] - before["cache_hit"] >= 1
    assert _metric(local, "nv_cache_num_entries ") is not None
    assert _metric(local, "nv_cache_num_hits ") == "nv_cache_num_hits 1"
    # the fleet's Redis cache is not this gateway's: gateways 0 and 1 show no local gauges
    assert _metric(fleet[0], "nv_cache_num_entries ") is None


def test_an_ensemble_hit_skips_its_steps(fleet: list[Service]) -> None:
    first, second, _ = fleet
    steps_before = _stats(first, "uncached")["inference_count"]
    assert _http(first, "doubled_twice", [1, 1, 2, 2]) == {"OUT": [[4, 4, 8, 8]]}
    assert _grpc(second, "doubled_twice", [1, 1, 2, 2]) == {"OUT": [[4, 4, 8, 8]]}
    wait_until(
        lambda: _stats(first, "uncached")["inference_count"] == steps_before + 2,
        "the first request's two steps",
    )
    wait_until(lambda: _stats(first, "doubled_twice")["cache_hit"] == 1, "the ensemble's hit")


def test_a_decoupled_model_cannot_enable_the_cache(fleet: list[Service]) -> None:
    request = urllib.request.Request(
        f"http://{fleet[0].http_url}/v2/repository/index", b"{}", method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        index = {m["name"]: m for m in json.loads(reply.read())}
    assert index["cached_decoupled"]["state"] == "UNAVAILABLE"
    assert index["cached_decoupled"]["reason"] == (
        "Response Cache does not currently support model cached_decoupled with 'decoupled' "
        "transaction policy. Please disable the response cache."
    )


def test_a_bad_cache_config_stops_the_gateway_with_its_reason(scratch_redis: Any) -> None:
    process = subprocess.run(
        [
            *(sys.executable, "-m", "sluice", "gateway", "--redis-url", scratch_redis.url),
            *("--cache-config", "local"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert process.returncode != 0
    assert "the local cache needs size=<bytes>" in process.stderr


def test_a_grpc_stream_is_answered_from_the_cache_too(fleet: list[Service]) -> None:
    first, second, _ = fleet
    expected = _http(first, "cached", [4, 3, 2, 1])  # computed, and cached fleet-wide
    hits = _stats(second, "cached")["cache_hit"]
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(second.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for request_id in ("a", "b"):
            tensor = grpcclient.InferInput("IN", [1, 4], "INT32")
            tensor.set_data_from_numpy(np.array([[4, 3, 2, 1]], dtype=np.int32))
            client.async_stream_infer("cached", [tensor], request_id=request_id)
        got = [answers.get(timeout=30) for _ in range(2)]
    finally:
        client.stop_stream()
    assert [error for _, error in got] == [None, None]
    assert sorted(result.get_response().id for result, _ in got) == ["a", "b"]
    for result, _ in got:
        assert {n: result.as_numpy(n).tolist() for n in expected} == expected
    assert _stats(second, "cached")["cache_hit"] == hits + 2
