"""Triton Python-backend model.py files, unchanged, served by `sluice serve` and driven with
tritonclient.http: batching, BYTES, BLS, errors, auto-complete, initialize/finalize, parameters."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import re
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from sluice.client import AsyncClient, Client, RedisClient
from sluice.client import errors as sdk_errors
from tests.backend_models import serving_fixtures
from tests.conftest import (
    HERE,
    Service,
    build_named_args_model,
    start_service,
    stop_service,
    wait_until,
)
from tests.streams import running_worker

MODELS = HERE / "triton_python_repo"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("triton_python") / "models"
    shutil.copytree(MODELS, repo)
    (repo / "scale" / "1").mkdir(parents=True, exist_ok=True)
    build_named_args_model(repo / "scale" / "1" / "model.pt")
    return repo


_service, _client = serving_fixtures()


def _input(name: str, array: np.ndarray, datatype: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=True)
    return tensor


def _error(pending: httpclient.InferAsyncRequest) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as err:
        pending.get_result()
    return err.value


def test_add_sub_gets_the_requests_of_one_batch_as_a_list(
    client: httpclient.InferenceServerClient,
) -> None:
    """Four requests sent together reach one execute call as a list of four (preferred
    batch size 4), each with its own unstacked inputs and its own answer."""
    pending = []
    for i in range(4):
        a = np.full((1, 4), i, np.float32)
        b = np.arange(4, dtype=np.float32)[None, :]
        inputs = [_input("INPUT0", a, "FP32"), _input("INPUT1", b, "FP32")]
        pending.append((a, b, client.async_infer("add_sub", inputs)))
    for a, b, request in pending:
        result = request.get_result()
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        assert result.as_numpy("REQUESTS").tolist() == [[4]]


def test_a_request_of_several_rows_is_one_request(
    client: httpclient.InferenceServerClient,
) -> None:
    """Two requests of two rows make the preferred batch of four rows: one call of two."""
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    inputs = [_input("INPUT0", a, "FP32"), _input("INPUT1", a, "FP32")]
    pending = [client.async_infer("add_sub", inputs) for _ in range(2)]
    for request in pending:
        result = request.get_result()
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)
        assert result.as_numpy("REQUESTS").tolist() == [[2]] * 2


def test_bytes_in_and_out(client: httpclient.InferenceServerClient) -> None:
    text = np.array([b"hello", "wörld".encode(), b"\x00bin"], dtype=np.object_)
    result = client.infer("strings", [_input("TEXT", text, "BYTES")])
    assert result.as_numpy("UPPER").tolist() == [b"HELLO", "WöRLD".encode(), b"\x00BIN"]
    assert result.as_numpy("LENGTH").tolist() == [5, 6, 4]
    assert result.get_output("LENGTH")["datatype"] == "INT64"


def test_bls_calls_a_torchscript_model_through_its_queue(
    client: httpclient.InferenceServerClient,
) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    target = np.array([[b"scale"], [b"scale"]], dtype=np.object_)
    result = client.infer("bls_scale", [_input("X", x, "FP32"), _input("TARGET", target, "BYTES")])
    np.testing.assert_array_equal(result.as_numpy("Y"), x * 2)


def test_bls_reaches_a_model_that_only_another_worker_serves(
    client: httpclient.InferenceServerClient, service: Service, tmp_path: Path
) -> None:
    """The call goes through the target's stream, so the fleet's other worker runs it."""
    remote = tmp_path / "remote"
    (remote / "remote_scale" / "1").mkdir(parents=True)
    config = (MODELS / "scale" / "config.pbtxt").read_text()
    (remote / "remote_scale" / "config.pbtxt").write_text(
        config.replace('name: "scale"', 'name: "remote_scale"', 1)
    )
    build_named_args_model(remote / "remote_scale" / "1" / "model.pt")
    assert not client.is_model_ready("remote_scale")
    with running_worker(remote, service.redis_url):
        wait_until(lambda: client.is_model_ready("remote_scale"), "the other worker's model")
        x = np.arange(3, dtype=np.float32)[None, :]
        target = np.array([[b"remote_scale"]], dtype=np.object_)
        inputs = [_input("X", x, "FP32"), _input("TARGET", target, "BYTES")]
        np.testing.assert_array_equal(client.infer("bls_scale", inputs).as_numpy("Y"), x * 2)


def test_a_bls_error_comes_back_as_the_response_error(
    client: httpclient.InferenceServerClient,
) -> None:
    x = np.ones((1, 3), np.float32)
    target = np.array([[b"no_such_model"]], dtype=np.object_)
    with pytest.raises(InferenceServerException) as err:
        client.infer("bls_scale", [_input("X", x, "FP32"), _input("TARGET", target, "BYTES")])
    assert "Model 'no_such_model' is not ready." in err.value.message()


def test_async_execute_awaits_bls_calls_together(
    client: httpclient.InferenceServerClient,
) -> None:
    x = np.arange(3, dtype=np.float32)[None, :]
    result = client.infer("bls_async", [_input("X", x, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("TWICE"), x * 2)
    np.testing.assert_array_equal(result.as_numpy("THRICE"), x * 3)


def _modes(client: httpclient.InferenceServerClient, modes: list[int]) -> list:
    return [
        client.async_infer("errors", [_input("MODE", np.array([[m]], np.int32), "INT32")])
        for m in modes
    ]


@pytest.mark.parametrize("n", [3, 0])
def test_a_decoupled_bls_call_streams_every_response(
    client: httpclient.InferenceServerClient, n: int
) -> None:
    """bls_decoupled has no config.pbtxt (auto-completed); it iterates square_decoupled's n
    responses and its flag-only final one, as python_backend's bls_decoupled example."""
    result = client.infer("bls_decoupled", [_input("IN", np.array([n], np.int32), "INT32")])
    assert result.as_numpy("SUM").tolist() == [n * n]
    assert result.as_numpy("COUNT").tolist() == [n + 1]
    config = client.get_model_config("bls_decoupled")
    assert (config["backend"], [i["name"] for i in config["input"]]) == ("python", ["IN"])


def test_a_decoupled_models_response_stats_stay_empty_as_tritons_python_backend_leaves_them(
    client: httpclient.InferenceServerClient, service: Service
) -> None:
    """tritonserver 2.51 on a decoupled Python model that sent responses: response_stats {}
    (its Python backend reports no per-response statistics), over HTTP and gRPC alike."""
    client.infer("bls_decoupled", [_input("IN", np.array([2], np.int32), "INT32")])
    wait_until(
        lambda: (
            client.get_inference_statistics("square_decoupled")["model_stats"][0]["execution_count"]
            > 0
        ),
        "square_decoupled's statistics",
    )
    stats = client.get_inference_statistics("square_decoupled")["model_stats"][0]
    assert stats["response_stats"] == {}
    with grpcclient.InferenceServerClient(service.grpc_url) as grpc:
        (model,) = grpc.get_inference_statistics("square_decoupled").model_stats
    assert model.execution_count > 0 and len(model.response_stats) == 0


def test_the_sdks_job_readers_return_every_response_of_a_decoupled_job(service: Service) -> None:
    """`Job.responses()` (HTTP, asyncio, straight to Redis): each response in order, the
    flag-only final one left out; `result()` is the last one; an error response raises."""
    inputs = {"IN": np.array([3], np.int32)}
    with Client(service.http_url) as sdk, RedisClient(service.redis_url) as direct:
        jobs = [sdk.submit("countdown", inputs), direct.submit("countdown", inputs)]
        for job in jobs:
            assert [r["OUT"].tolist() for r in job.responses(timeout_s=60)] == [[2], [1], [0]]
            assert job.result(timeout_s=60)["OUT"].tolist() == [0]
        for job in (sdk.submit("countdown", {"IN": np.array([-1], np.int32)}),):
            with pytest.raises(sdk_errors.SluiceClientError, match="below zero"):
                job.responses(timeout_s=60)

    async def read() -> list[list[int]]:
        async with AsyncClient(service.http_url) as client:
            job = await client.submit("countdown", {"IN": np.array([2], np.int32)})
            return [r["OUT"].tolist() for r in await job.responses(timeout_s=60)]

    assert asyncio.run(read()) == [[1], [0]]


def test_a_failed_decoupled_bls_call_is_an_error_response(
    client: httpclient.InferenceServerClient,
) -> None:
    with pytest.raises(InferenceServerException, match="Model 'absent' is not ready"):
        client.infer("bls_decoupled", [_input("IN", np.array([-1], np.int32), "INT32")])


def test_async_decoupled_bls_calls_awaited_together(
    client: httpclient.InferenceServerClient,
) -> None:
    result = client.infer("bls_decoupled_async", [_input("IN", np.array([4], np.int32), "INT32")])
    assert result.as_numpy("SUM").tolist() == [2 * 4 * 4]


def test_a_models_own_metrics_are_on_the_metrics_port(
    service: Service, client: httpclient.InferenceServerClient
) -> None:
    """custom_metrics counts its rows and observes its values (pb_utils.MetricFamily); the
    gateway shows them beside the nv_* families, once the worker's next heartbeat is in."""
    x = np.array([[0.5, 4.0], [20.0, 1.0]], np.float32)
    client.infer("custom_metrics", [_input("IN", x, "FP32")])
    url = f"http://{service.metrics_url}/metrics"
    scraped: list[str] = []

    def counted() -> bool:
        scraped[:] = [urllib.request.urlopen(url).read().decode()]
        return 'test_rows_total{model="custom_metrics",version="1"} 2\n' in scraped[0]

    wait_until(counted, "the model's counter on /metrics")
    text = scraped[0]
    assert "# HELP test_rows_total Rows run\n# TYPE test_rows_total counter\n" in text
    assert "\nnv_inference_count{" in text
    assert 'test_values_bucket{model="custom_metrics",le="1"} 2\n' in text
    assert 'test_values_bucket{model="custom_metrics",le="10"} 3\n' in text
    assert 'test_values_count{model="custom_metrics"} 4\n' in text


def test_a_per_request_error_answers_that_request_alone_with_tritons_status(
    client: httpclient.InferenceServerClient,
) -> None:
    statuses = {1: "400", 2: "404", 3: "503", 4: "501", 5: "400", 6: "400", 7: "500"}
    pending = _modes(client, [0, 1, 2, 3, 4, 5, 6, 7])
    assert pending[0].get_result().as_numpy("OUT").tolist() == [[0]]
    for mode, request in zip(range(1, 8), pending[1:], strict=True):
        error = _error(request)
        assert error.message() == f"mode {mode} is refused"
        assert error.status() == statuses[mode], mode


def _errors_counts(client: httpclient.InferenceServerClient, url: str) -> dict[str, int]:
    """The errors model's counters, from its statistics and from /metrics."""
    stats = client.get_inference_statistics("errors")["model_stats"][0]
    counts = {f"{k}.count": int(v["count"]) for k, v in stats["inference_stats"].items()}
    counts["fail.ns"] = int(stats["inference_stats"]["fail"]["ns"])
    counts["success.ns"] = int(stats["inference_stats"]["success"]["ns"])
    counts["inference_count"] = int(stats["inference_count"])
    counts["execution_count"] = int(stats["execution_count"])
    text = urllib.request.urlopen(url).read().decode()
    for name, labels in (
        ("nv_inference_request_success", 'model="errors",version="1"'),
        ("nv_inference_request_failure", 'model="errors",reason="BACKEND",version="1"'),
    ):
        found = re.search(rf"^{name}{{{labels}}} (\d+)", text, re.MULTILINE)
        counts[name] = int(found.group(1)) if found else 0
    return counts


def _batch_counts(
    client: httpclient.InferenceServerClient, url: str, modes: list[int]
) -> dict[str, int]:
    """What one batch of the errors model (one request per mode) adds to its counters."""
    before = _errors_counts(client, url)
    for request in _modes(client, modes):
        with contextlib.suppress(InferenceServerException):
            request.get_result()
    wait_until(
        lambda: _errors_counts(client, url)["execution_count"] > before["execution_count"],
        "the batch's statistics",
    )
    after = _errors_counts(client, url)
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_errors_count_as_triton_2_51_counts_a_python_models(
    client: httpclient.InferenceServerClient, service: Service
) -> None:
    """Read off tritonserver 2.51 on the same model: requests a Python model answers with
    `InferenceResponse(error=...)` count as successes; an `execute` that raises fails its
    call's requests, counted as failures (fail count and duration,
    nv_inference_request_failure{reason="BACKEND"}) with no queue or compute samples, while
    the batch's size still counts them."""
    url = f"http://{service.metrics_url}/metrics"
    answered = _batch_counts(client, url, [0, 1, 0, 3])
    answered.pop("success.ns", None)
    assert answered == {
        "success.count": 4,
        "queue.count": 4,
        "compute_input.count": 4,
        "compute_infer.count": 4,
        "compute_output.count": 4,
        "inference_count": 4,
        "execution_count": 1,
        "nv_inference_request_success": 4,
    }
    failed = _batch_counts(client, url, [0, 9, 0, 0])
    assert failed.pop("fail.ns") > 0
    assert failed == {
        "fail.count": 4,
        "inference_count": 4,
        "execution_count": 1,
        "nv_inference_request_failure": 4,
    }


def test_over_grpc_a_per_request_error_has_tritons_grpc_status(service: Service) -> None:
    expected = {1: "INVALID_ARGUMENT", 2: "NOT_FOUND", 3: "UNAVAILABLE", 4: "UNIMPLEMENTED"}
    answers: queue.Queue[tuple[int, object]] = queue.Queue()
    with grpcclient.InferenceServerClient(service.grpc_url) as client:
        for mode in expected:
            tensor = grpcclient.InferInput("MODE", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[mode]], np.int32))
            client.async_infer(
                "errors", [tensor], lambda result, error, m=mode: answers.put((m, error))
            )
        got = dict(answers.get(timeout=60) for _ in expected)
    for mode, status in expected.items():
        error = got[mode]
        assert isinstance(error, InferenceServerException)
        assert (error.status(), error.message()) == (
            f"StatusCode.{status}",
            f"mode {mode} is refused",
        )


def test_an_exception_from_execute_fails_every_request_of_that_call_only(
    client: httpclient.InferenceServerClient,
) -> None:
    """No halving to find the culprit: the model's three good requests in the same call fail
    too, as in Triton; the next call is unaffected."""
    for request in _modes(client, [0, 9, 0, 0]):
        error = _error(request)
        assert error.status() == "500"
        assert error.message() == (
            "Failed to process the request(s) for model 'errors', message: "
            "TritonModelException: mode 9 fails the whole call"
        )
    for mode, request in zip([0, 8, 0, 0], _modes(client, [0, 8, 0, 0]), strict=True):
        assert request.get_result().as_numpy("OUT").tolist() == [[mode * 10]]


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (20, "Expected a list in the execute return, found type '<class 'tuple'>'."),
        (
            21,
            "Number of InferenceResponse objects do not match the number of InferenceRequest "
            "objects. InferenceRequest(s) size is:4, and InferenceResponse(s) size is:3",
        ),
        (
            22,
            "Expected an 'InferenceResponse' object in the execute function return list, "
            "found type '<class 'str'>'.",
        ),
    ],
)
def test_an_execute_return_that_breaks_the_contract_fails_the_call(
    client: httpclient.InferenceServerClient, mode: int, message: str
) -> None:
    prefix = "Failed to process the request(s) for model 'errors', message: "
    for request in _modes(client, [0, 0, 0, mode]):
        assert _error(request).message() == prefix + message


def test_auto_complete_config_fills_in_inputs_outputs_and_batching(
    client: httpclient.InferenceServerClient,
) -> None:
    config = client.get_model_config("autocomplete")
    assert [i["name"] for i in config["input"]] == ["IN"]
    assert config["output"][0]["data_type"] == "TYPE_INT64"
    assert config["max_batch_size"] == 4
    assert "dynamic_batching" in config
    x = np.array([[1, 2], [3, 4]], np.int64)
    result = client.infer("autocomplete", [_input("IN", x, "INT64")])
    np.testing.assert_array_equal(result.as_numpy("OUT"), x * 3)


def test_initialize_gets_tritons_seven_args(
    client: httpclient.InferenceServerClient, repo: Path
) -> None:
    result = client.infer("init_args", [_input("IN", np.array([1], np.int32), "INT32")])
    args = json.loads(result.as_numpy("ARGS")[0])
    assert set(args) == {
        "model_config",
        "model_instance_kind",
        "model_instance_name",
        "model_instance_device_id",
        "model_repository",
        "model_version",
        "model_name",
    }
    assert json.loads(args["model_config"]) == client.get_model_config("init_args")
    assert args["model_instance_kind"] == "CPU"
    assert args["model_instance_name"] in ("pair_0", "pair_1")
    assert args["model_instance_device_id"] == "0"
    assert args["model_repository"] == str(repo / "init_args")
    assert (args["model_version"], args["model_name"]) == ("1", "init_args")
    assert result.as_numpy("MODEL_DIR")[0].decode() == str(repo / "init_args" / "1")


def test_custom_parameters_and_requested_outputs_reach_the_model(
    client: httpclient.InferenceServerClient,
) -> None:
    one = [_input("IN", np.array([1], np.int32), "INT32")]
    result = client.infer(
        "params",
        one,
        outputs=[httpclient.InferRequestedOutput(n) for n in ("PARAMETERS", "REQUESTED")],
        parameters={"custom": "yes", "n": 3, "flag": True},
        priority=0,
    )
    assert json.loads(result.as_numpy("PARAMETERS")[0]) == {"custom": "yes", "n": 3, "flag": True}
    assert result.as_numpy("REQUESTED").tolist() == [b"PARAMETERS", b"REQUESTED"]
    assert result.as_numpy("CORRELATION") is None
    result = client.infer("params", one, sequence_id=42)
    assert json.loads(result.as_numpy("PARAMETERS")[0]) == {}
    assert result.as_numpy("REQUESTED").tolist() == [b"CORRELATION", b"PARAMETERS", b"REQUESTED"]
    assert result.as_numpy("CORRELATION").tolist() == [42]


def test_response_parameters_reach_the_client_typed_over_http_and_grpc(
    client: httpclient.InferenceServerClient, service: Service
) -> None:
    """`InferenceResponse(..., parameters={...})`: in the JSON response's "parameters" and
    in ModelInferResponse.parameters (a stream's responses too), bool, int and str kept."""
    one = [_input("IN", np.array([1], np.int32), "INT32")]
    result = client.infer("params", one, sequence_id=7)
    assert result.get_response()["parameters"] == {
        "outputs": 3,
        "in_sequence": True,
        "model": "params",
    }
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], np.int32))
    wanted = [grpcclient.InferRequestedOutput("REQUESTED")]
    streamed: queue.Queue[object] = queue.Queue()
    with grpcclient.InferenceServerClient(service.grpc_url) as grpc:
        answer = grpc.infer("params", [tensor], outputs=wanted).get_response()
        grpc.start_stream(lambda result, error: streamed.put(error or result))
        grpc.async_stream_infer("params", [tensor], outputs=wanted)
        sent = streamed.get(timeout=60)
        grpc.stop_stream()
    for params in (answer.parameters, sent.get_response().parameters):  # type: ignore[union-attr]
        assert params["outputs"].WhichOneof("parameter_choice") == "int64_param"
        assert params["outputs"].int64_param == 1
        assert params["in_sequence"].WhichOneof("parameter_choice") == "bool_param"
        assert params["in_sequence"].bool_param is False
        assert params["model"].string_param == "params"


def test_a_decoupled_models_responses_carry_their_own_parameters(service: Service) -> None:
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([2], np.int32))
    streamed: queue.Queue[object] = queue.Queue()
    with grpcclient.InferenceServerClient(service.grpc_url) as grpc:
        grpc.start_stream(lambda result, error: streamed.put(error or result))
        grpc.async_stream_infer("countdown", [tensor])
        sent = [streamed.get(timeout=60) for _ in range(2)]
        grpc.stop_stream()
    left = [r.get_response().parameters["left"].int64_param for r in sent]  # type: ignore[attr-defined]
    assert left == [1, 0]


def test_a_decoupled_model_is_served_and_http_infer_refuses_it(
    client: httpclient.InferenceServerClient,
) -> None:
    """Its responses need a stream (tests/test_decoupled.py); /infer answers as Triton's."""
    assert client.is_model_ready("decoupled")
    with pytest.raises(InferenceServerException) as err:
        client.infer("decoupled", [_input("IN", np.array([1], np.int32), "INT32")])
    assert err.value.status() == "501"


def test_an_unload_finalizes_the_models_instances(tmp_path: Path, redis_url: str) -> None:
    repo = tmp_path / "models"
    shutil.copytree(MODELS / "init_args", repo / "init_args")
    args = ["--model-repository", str(repo), "--redis-url", redis_url]
    explicit = ["--model-control-mode", "explicit", "--load-model", "init_args"]
    svc = start_service([*args, *explicit])
    try:
        with httpclient.InferenceServerClient(svc.http_url) as client:
            assert client.is_model_ready("init_args")
            assert not list((repo / "init_args").glob("finalized-*"))
            client.unload_model("init_args")
            wait_until(
                lambda: bool(list((repo / "init_args").glob("finalized-*"))), "finalize on unload"
            )
            assert svc.process.poll() is None
    finally:
        stop_service(svc)


def test_finalize_is_called_when_the_worker_stops(service: Service, repo: Path) -> None:
    """Runs last: it stops the module's service."""
    assert not list((repo / "init_args").glob("finalized-*"))
    assert stop_service(service) == 0
    assert [p.name for p in (repo / "init_args").glob("finalized-*")] != []
    assert {p.read_text() for p in (repo / "init_args").glob("finalized-*")} == {"finalized"}
