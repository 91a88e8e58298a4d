"""End to end through tritonclient.grpc (and raw protobuf messages) against `sluice serve`."""

from __future__ import annotations

import json
import queue
import shutil
from collections.abc import Iterator
from functools import partial
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf.json_format import MessageToDict
from sluice.shared.redis_client import sync_client
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import HERE, Service, start_sluice, stop_service, wait_until
from tests.grpc_calls import ARRAYS, dtypes_inputs, expect_a_cancel, grpc_input, status_of

Status = grpc.StatusCode


@pytest.fixture
def client(service: Service) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(service.grpc_url) as own:
        yield own


@pytest.fixture
def stub(service: Service) -> Iterator[Any]:
    """The generated stub on a plain channel, for messages tritonclient does not build."""
    with grpc.insecure_channel(service.grpc_url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


# -- server and models ------------------------------------------------------------------------


def test_health_and_server_metadata(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata(as_json=True)
    assert (meta["name"], meta["version"]) == ("triton", "2.51.0")
    assert "sluice/0.1.0" in meta["extensions"]
    assert {"binary_tensor_data", "model_configuration", "statistics"} <= set(meta["extensions"])


def test_model_readiness(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_model_ready("batch8")
    assert client.is_model_ready("batch8", "1")
    assert not client.is_model_ready("batch8", "7")
    assert not client.is_model_ready("broken")
    assert not client.is_model_ready("no_such_model")


def test_model_metadata_and_config(client: grpcclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("batch8", as_json=True)
    assert meta["name"] == "batch8"
    assert meta["versions"] == ["1"]
    assert meta["platform"] == "python"
    assert meta["inputs"] == [{"name": "IN", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert client.get_model_metadata("nobatch").inputs[0].shape == [2, 3]
    config = client.get_model_config("batch8").config
    assert config.max_batch_size == 8
    assert config.dynamic_batching.max_queue_delay_microseconds == 1000000
    assert config.input[0].name == "IN"
    assert list(config.input[0].dims) == [4]
    assert config.input[0].data_type == grpcclient.model_config_pb2.TYPE_FP32


def test_every_ready_model_config_matches_http(
    client: grpcclient.InferenceServerClient, service: Service
) -> None:
    """The config JSON the gateway holds fits ModelConfig for every model, field for field."""
    http = httpclient.InferenceServerClient(service.http_url)
    ready = [m["name"] for m in http.get_model_repository_index() if m.get("state") == "READY"]
    assert len(ready) >= 5
    for name in ready:
        config = client.get_model_config(name).config
        as_json = MessageToDict(config, preserving_proto_field_name=True)
        expected = http.get_model_config(name)
        assert as_json["name"] == expected["name"]
        assert as_json.get("max_batch_size", 0) == expected.get("max_batch_size", 0)
        assert [i["name"] for i in as_json["input"]] == [i["name"] for i in expected["input"]]
        assert [o["data_type"] for o in as_json["output"]] == [
            o["data_type"] for o in expected["output"]
        ]


def test_metadata_of_an_unknown_model_is_not_found(
    client: grpcclient.InferenceServerClient,
) -> None:
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("no_such_model")
    assert status_of(err) == "StatusCode.NOT_FOUND"
    assert "no_such_model" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.get_model_config("broken")
    assert status_of(err) == "StatusCode.NOT_FOUND"


def test_statistics_count_grpc_requests(client: grpcclient.InferenceServerClient) -> None:
    def count() -> int:
        stats = client.get_inference_statistics("affine", as_json=True)["model_stats"]
        return int(stats[0].get("inference_count", 0))

    before = count()
    x = np.ones((3, 4), np.float32)
    client.infer("affine", [grpc_input("X", x, "FP32")])
    assert count() == before + 3
    every = client.get_inference_statistics(as_json=True)["model_stats"]
    assert {"affine", "batch8", "dtypes"} <= {s["name"] for s in every}


def test_repository_index(client: grpcclient.InferenceServerClient, stub: Any) -> None:
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert (index["batch8"].state, index["batch8"].version) == ("READY", "1")
    assert index["broken"].state == "UNAVAILABLE"
    assert "preferred_batch_size" in index["broken"].reason
    ready = stub.RepositoryIndex(pb.RepositoryIndexRequest(ready=True)).models
    assert "batch8" in {m.name for m in ready}
    assert "broken" not in {m.name for m in ready}


def test_load_and_unload_need_explicit_mode(client: grpcclient.InferenceServerClient) -> None:
    for call in (client.load_model, client.unload_model):
        with pytest.raises(InferenceServerException) as err:
            call("affine")
        assert status_of(err) == "StatusCode.UNAVAILABLE"
        assert "explicit model load / unload is not allowed" in err.value.message()


@pytest.fixture(scope="module")
def explicit(
    scratch_redis: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """`sluice serve` in explicit mode on a repository of affine and batch8, batch8 loaded,
    on a Redis of its own (the session's service serves affine)."""
    flush = sync_client(scratch_redis.url)
    flush.flushall()
    flush.close()
    repo = tmp_path_factory.mktemp("grpc-explicit") / "models"
    for model in ("affine", "batch8"):
        shutil.copytree(HERE / "model_repo" / model, repo / model)
    args = ["--model-repository", str(repo), "--redis-url", scratch_redis.url]
    args += ["--model-control-mode", "explicit", "--load-model", "batch8", "--bulk-workers", "0"]
    service = start_sluice("serve", args)
    yield service
    stop_service(service)


def test_load_with_a_config_then_unload(explicit: Service) -> None:
    x = np.ones((1, 4), np.float32)
    with grpcclient.InferenceServerClient(explicit.grpc_url) as client:
        assert not client.is_model_ready("affine")
        client.load_model("affine")
        assert client.is_model_ready("affine")
        y = client.infer("affine", [grpc_input("X", x, "FP32")]).as_numpy("Y")
        np.testing.assert_array_equal(y, x * 2 + 1)
        config = MessageToDict(
            client.get_model_config("affine").config, preserving_proto_field_name=True
        )
        config["max_batch_size"] = 16
        config["dynamic_batching"]["preferred_batch_size"] = [16]
        client.load_model("affine", config=json.dumps(config))
        assert client.get_model_config("affine").config.max_batch_size == 16
        with pytest.raises(InferenceServerException) as err:
            client.infer("affine", [grpc_input("X", np.ones((17, 4), np.float32), "FP32")])
        assert "batch-size must be <= 16" in err.value.message()
        client.unload_model("affine")

        def unloaded() -> bool:
            index = {m.name: m for m in client.get_model_repository_index().models}
            return (index["affine"].state, index["affine"].reason) == ("UNAVAILABLE", "unloaded")

        wait_until(unloaded, "affine unloaded")
        assert not client.is_model_ready("affine")
        assert client.is_model_ready("batch8")


def test_failed_loads_carry_tritons_codes(explicit: Service) -> None:
    with grpcclient.InferenceServerClient(explicit.grpc_url) as client:
        with pytest.raises(InferenceServerException) as err:
            client.load_model("batch8", config=json.dumps({"max_batch_size": "lots"}))
        assert status_of(err) == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException) as err:
            client.load_model("no_such_model")
        assert status_of(err) == "StatusCode.INTERNAL"  # Triton's code for a model it cannot poll
        assert "failed to poll from model repository" in err.value.message()


# -- infer ------------------------------------------------------------------------------------


def test_every_datatype_round_trips(client: grpcclient.InferenceServerClient) -> None:
    result = client.infer("dtypes", dtypes_inputs(), request_id="all-types")
    for dt, array in ARRAYS.items():
        got = result.as_numpy(f"OUT_{dt}")
        assert got.dtype == array.dtype or dt == "BYTES", dt
        np.testing.assert_array_equal(got, array, err_msg=dt)
    np.testing.assert_array_equal(result.as_numpy("OUT_BF16"), [[1.5, -2.25]])
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == (
        "all-types",
        "dtypes",
        "1",
    )


def test_only_the_requested_outputs_come_back(client: grpcclient.InferenceServerClient) -> None:
    wanted = [grpcclient.InferRequestedOutput(n) for n in ("OUT_INT64", "OUT_BYTES")]
    response = client.infer("dtypes", dtypes_inputs(), outputs=wanted).get_response()
    assert sorted(o.name for o in response.outputs) == ["OUT_BYTES", "OUT_INT64"]
    assert len(response.raw_output_contents) == 2


def test_typed_contents_are_served(stub: Any) -> None:
    tensor = pb.ModelInferRequest.InferInputTensor(name="X", datatype="FP32", shape=[2, 4])
    tensor.contents.fp32_contents.extend(range(8))
    response = stub.ModelInfer(pb.ModelInferRequest(model_name="affine", id="t", inputs=[tensor]))
    assert response.id == "t"
    y = np.frombuffer(response.raw_output_contents[0], np.float32)
    np.testing.assert_array_equal(y, np.arange(8) * 2 + 1)
    tensor = pb.ModelInferRequest.InferInputTensor(name="IN", datatype="INT32", shape=[1, 3])
    tensor.contents.int_contents.extend([1, 2, 3])
    response = stub.ModelInfer(pb.ModelInferRequest(model_name="varlen", inputs=[tensor]))
    assert np.frombuffer(response.raw_output_contents[0], np.int64).tolist() == [6]


def test_raw_and_typed_contents_may_not_mix(stub: Any) -> None:
    tensor = pb.ModelInferRequest.InferInputTensor(name="X", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents.extend(range(4))
    request = pb.ModelInferRequest(
        model_name="affine", inputs=[tensor], raw_input_contents=[b"\0" * 16]
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request)
    assert err.value.code() == Status.INVALID_ARGUMENT
    assert "contents field must not be specified" in err.value.details()


@pytest.mark.parametrize(
    ("model", "inputs", "status", "message"),
    [
        ("no_such_model", [("X", np.ones((1, 4), np.float32), "FP32")], "NOT_FOUND", "no_such"),
        ("broken", [("X", np.ones((1, 4), np.float32), "FP32")], "NOT_FOUND", "broken"),
        ("affine", [("X", np.ones((1, 5), np.float32), "FP32")], "INVALID_ARGUMENT", "shape"),
        ("affine", [("X", np.ones((1, 4), np.int32), "INT32")], "INVALID_ARGUMENT", "data-type"),
        ("affine", [("Y", np.ones((1, 4), np.float32), "FP32")], "INVALID_ARGUMENT", "'Y'"),
        ("affine", [("X", np.full((1, 4), 13, np.float32), "FP32")], "INTERNAL", "unlucky"),
    ],
    ids=["unknown-model", "not-ready", "shape", "datatype", "name", "model-raises"],
)
def test_errors_carry_tritons_status_codes(
    client: grpcclient.InferenceServerClient,
    model: str,
    inputs: list[tuple[str, np.ndarray, str]],
    status: str,
    message: str,
) -> None:
    with pytest.raises(InferenceServerException) as err:
        client.infer(model, [grpc_input(*spec) for spec in inputs])
    assert status_of(err) == f"StatusCode.{status}"
    assert message in err.value.message()


def test_an_unknown_version_is_not_found(client: grpcclient.InferenceServerClient) -> None:
    x = np.ones((1, 4), np.float32)
    with pytest.raises(InferenceServerException) as err:
        client.infer("batch8", [grpc_input("IN", x, "FP32")], model_version="7")
    assert status_of(err) == "StatusCode.NOT_FOUND"
    assert "'batch8' version 7 is not found" in err.value.message()


def test_concurrent_grpc_requests_fill_one_batch(client: grpcclient.InferenceServerClient) -> None:
    def batches() -> dict[int, int]:
        stats = client.get_inference_statistics("batch8", "1", as_json=True)["model_stats"][0]
        ran = stats.get("batch_stats", [])  # as_json leaves out what is empty or 0
        return {int(b["batch_size"]): int(b["compute_infer"].get("count", 0)) for b in ran}

    before = batches()
    results: queue.Queue[tuple[int, Any, Any]] = queue.Queue()
    x = np.ones((1, 4), np.float32)
    for i in range(8):
        client.async_infer(
            "batch8",
            [grpc_input("IN", x * i, "FP32")],
            partial(lambda i, result, error: results.put((i, result, error)), i),
        )
    for _ in range(8):
        i, result, error = results.get(timeout=30)
        assert error is None, error
        np.testing.assert_array_equal(result.as_numpy("OUT"), x * i * 2)
    after = batches()
    assert after.get(8, 0) - before.get(8, 0) == 1
    assert sum(after.values()) - sum(before.values()) == 1


def test_a_request_past_its_deadline_is_unavailable(
    client: grpcclient.InferenceServerClient,
) -> None:
    """batch8 waits up to a second to fill a batch: a 1 ms deadline expires in the queue."""
    with pytest.raises(InferenceServerException) as err:
        client.infer(
            "batch8",
            [grpc_input("IN", np.ones((1, 4), np.float32), "FP32")],
            parameters={"deadline_us": 1000},
        )
    assert status_of(err) == "StatusCode.UNAVAILABLE"
    assert "deadline exceeded" in err.value.message()


def test_a_cancelled_call_leaves_the_queue(
    client: grpcclient.InferenceServerClient, service: Service
) -> None:
    """A client deadline shorter than batch8's batching delay: the gateway tells the workers
    to drop the request, as it does for a closed HTTP connection."""
    with expect_a_cancel(service.redis_url, "batch8"):
        with pytest.raises(InferenceServerException) as err:
            client.infer(
                "batch8",
                [grpc_input("IN", np.ones((1, 4), np.float32), "FP32")],
                client_timeout=0.3,
            )
        assert status_of(err) == "StatusCode.DEADLINE_EXCEEDED"


def test_compressed_requests_are_served(client: grpcclient.InferenceServerClient) -> None:
    x = np.zeros((2, 4), np.float32)
    for algorithm in ("gzip", "deflate"):
        result = client.infer(
            "affine", [grpc_input("X", x, "FP32")], compression_algorithm=algorithm
        )
        np.testing.assert_array_equal(result.as_numpy("Y"), x * 2 + 1)


# -- stream -----------------------------------------------------------------------------------


def test_stream_answers_every_request_with_errors_in_band(
    client: grpcclient.InferenceServerClient,
) -> None:
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        x = np.arange(4, dtype=np.float32)[None, :]
        client.async_stream_infer("affine", [grpc_input("X", x, "FP32")], request_id="a")
        client.async_stream_infer("affine", [grpc_input("X", x[:, :3], "FP32")], request_id="bad")
        client.async_stream_infer("no_such_model", [grpc_input("X", x, "FP32")], request_id="lost")
        client.async_stream_infer("affine", [grpc_input("X", x + 1, "FP32")], request_id="b")
        answers = [results.get(timeout=30) for _ in range(4)]
        client.async_stream_infer("affine", [grpc_input("X", x + 2, "FP32")], request_id="c")
        answers.append(results.get(timeout=30))
    finally:
        client.stop_stream()
    served = {r.get_response().id: r.as_numpy("Y") for r, e in answers if e is None}
    assert sorted(served) == ["a", "b", "c"]
    for offset, request_id in enumerate("abc"):
        np.testing.assert_array_equal(served[request_id], (x + offset) * 2 + 1)
    errors = sorted(e.message() for r, e in answers if e is not None)
    assert len(errors) == 2
    assert "shape" in errors[1] and "no_such_model" in errors[0]


def test_stream_sends_each_response_when_it_is_done(stub: Any) -> None:
    """batch8 holds its request for its batching delay; affine's, sent after, comes first."""

    def request(model: str, name: str, request_id: str) -> Any:
        tensor = pb.ModelInferRequest.InferInputTensor(name=name, datatype="FP32", shape=[1, 4])
        tensor.contents.fp32_contents.extend([1, 2, 3, 4])
        return pb.ModelInferRequest(model_name=model, id=request_id, inputs=[tensor])

    requests = [request("batch8", "IN", "slow"), request("affine", "X", "fast")]
    responses = list(stub.ModelStreamInfer(iter(requests), timeout=30))
    assert [r.infer_response.id for r in responses] == ["fast", "slow"]
    assert not any(r.error_message for r in responses)


# -- what Triton's other extensions answer ----------------------------------------------------


def test_shared_memory_trace_and_log_extensions(stub: Any) -> None:
    assert not stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest()).regions
    assert not stub.CudaSharedMemoryStatus(pb.CudaSharedMemoryStatusRequest()).regions
    calls = [
        (stub.SystemSharedMemoryRegister, pb.SystemSharedMemoryRegisterRequest(name="r")),
        (stub.CudaSharedMemoryRegister, pb.CudaSharedMemoryRegisterRequest(name="r")),
    ]
    failures = []
    for method, message in calls:
        with pytest.raises(grpc.RpcError) as err:
            method(message)
        failures.append((err.value.code(), err.value.details()))
    assert failures == [
        (Status.INTERNAL, "Unable to open shared memory region: ''"),
        (
            Status.INVALID_ARGUMENT,
            "failed to register CUDA shared memory region: 'r', GPUs not supported",
        ),
    ]
    # the trace and logging extensions answer (tests/test_tracing.py and
    # tests/test_logging_extension.py have the rest)
    trace = stub.TraceSetting(pb.TraceSettingRequest()).settings
    assert list(trace["trace_mode"].value) == ["triton"]
    settings = stub.LogSettings(pb.LogSettingsRequest()).settings
    assert settings["log_error"].bool_param is True
    assert settings["log_format"].string_param in ("default", "ISO8601")


# -- health and readiness ---------------------------------------------------------------------


def test_the_grpc_health_check_says_serving(service: Service) -> None:
    """grpc.health.v1.Health/Check, as probes send it: HealthCheckRequest{service: ""}."""
    with grpc.insecure_channel(service.grpc_url) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        assert check(b"") == b"\x08\x01"  # status: SERVING
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/grpc.health.v1.Health/Watch")(b"")
        assert err.value.code() == Status.UNIMPLEMENTED


def test_serve_names_its_grpc_port_when_ready(service: Service) -> None:
    port = service.grpc_url.rsplit(":", 1)[1]
    [ready] = [line for line in service.log if "sluice ready" in line]
    assert f"gRPC on :{port}" in ready


async def test_the_asyncio_client_too(service: Service) -> None:
    import tritonclient.grpc.aio as aioclient

    async with aioclient.InferenceServerClient(service.grpc_url) as client:
        assert await client.is_model_ready("affine")
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        tensor = aioclient.InferInput("X", [2, 4], "FP32")
        tensor.set_data_from_numpy(x)
        result = await client.infer("affine", [tensor], request_id="aio")
        np.testing.assert_array_equal(result.as_numpy("Y"), x * 2 + 1)
        assert result.get_response().id == "aio"
