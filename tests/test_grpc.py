"""End to end through tritonclient.grpc (and raw protobuf messages) against `sluice serve`."""

from __future__ import annotations

import contextlib
import json
import queue
import shutil
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf.json_format import MessageToDict
from sluice.shared import keys
from sluice.shared.datatypes import NUMPY_DTYPE
from sluice.shared.redis_client import sync_client
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import HERE, Service, start_sluice, stop_service, wait_until

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


def _input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _status(err: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return str(err.value.status())


# -- server and models ------------------------------------------------------------------------


def test_health_and_server_metadata(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "sluice"
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
    assert _status(err) == "StatusCode.NOT_FOUND"
    assert "no_such_model" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.get_model_config("broken")
    assert _status(err) == "StatusCode.NOT_FOUND"


def test_statistics_count_grpc_requests(client: grpcclient.InferenceServerClient) -> None:
    def count() -> int:
        stats = client.get_inference_statistics("affine", as_json=True)["model_stats"]
        return int(stats[0].get("inference_count", 0))

    before = count()
    x = np.ones((3, 4), np.float32)
    client.infer("affine", [_input("X", x, "FP32")])
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
        assert _status(err) == "StatusCode.UNAVAILABLE"
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
        y = client.infer("affine", [_input("X", x, "FP32")]).as_numpy("Y")
        np.testing.assert_array_equal(y, x * 2 + 1)
        config = MessageToDict(
            client.get_model_config("affine").config, preserving_proto_field_name=True
        )
        config["max_batch_size"] = 16
        config["dynamic_batching"]["preferred_batch_size"] = [16]
        client.load_model("affine", config=json.dumps(config))
        assert client.get_model_config("affine").config.max_batch_size == 16
        with pytest.raises(InferenceServerException) as err:
            client.infer("affine", [_input("X", np.ones((17, 4), np.float32), "FP32")])
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
        assert _status(err) == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException) as err:
            client.load_model("no_such_model")
        assert _status(err) == "StatusCode.INTERNAL"  # Triton's code for a model it cannot poll
        assert "failed to poll from model repository" in err.value.message()


# -- infer ------------------------------------------------------------------------------------


def _extremes(datatype: str) -> np.ndarray:
    """Two values of the datatype that a lossy path would change: its limits, or inexact
    floats, or bytes that are not text."""
    dtype = NUMPY_DTYPE[datatype]
    if datatype == "BYTES":
        return np.array([[b"hello", b"\x00\xffbin"]], np.object_)
    if datatype == "BOOL":
        return np.array([[True, False]])
    if dtype.kind == "f":
        return np.array([[1.5, -2.25]], dtype)
    info = np.iinfo(dtype)
    return np.array([[info.min, info.max]], dtype)


ARRAYS = {datatype: _extremes(datatype) for datatype in NUMPY_DTYPE if datatype != "BF16"}


def _dtypes_inputs() -> list[grpcclient.InferInput]:
    inputs = [_input(f"IN_{dt}", a, dt) for dt, a in ARRAYS.items()]
    inputs.append(_input("IN_BF16", np.array([[1.5, -2.25]], ml_dtypes.bfloat16), "BF16"))
    return inputs


def test_every_datatype_round_trips(client: grpcclient.InferenceServerClient) -> None:
    result = client.infer("dtypes", _dtypes_inputs(), request_id="all-types")
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
    response = client.infer("dtypes", _dtypes_inputs(), outputs=wanted).get_response()
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
        ("affine", [("X", np.ones((1, 4), np.int32), "INT32")], "INVALID_ARGUMENT", "datatype"),
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
        client.infer(model, [_input(*spec) for spec in inputs])
    assert _status(err) == f"StatusCode.{status}"
    assert message in err.value.message()


def test_an_unknown_version_is_not_found(client: grpcclient.InferenceServerClient) -> None:
    x = np.ones((1, 4), np.float32)
    with pytest.raises(InferenceServerException) as err:
        client.infer("batch8", [_input("IN", x, "FP32")], model_version="7")
    assert _status(err) == "StatusCode.NOT_FOUND"
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
            [_input("IN", x * i, "FP32")],
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
            [_input("IN", np.ones((1, 4), np.float32), "FP32")],
            parameters={"deadline_us": 1000},
        )
    assert _status(err) == "StatusCode.UNAVAILABLE"
    assert "deadline exceeded" in err.value.message()


def test_a_cancelled_call_leaves_the_queue(
    client: grpcclient.InferenceServerClient, service: Service
) -> None:
    """A client deadline shorter than batch8's batching delay: the gateway tells the workers
    to drop the request, as it does for a closed HTTP connection."""
    with _expect_a_cancel(service.redis_url, "batch8"):
        with pytest.raises(InferenceServerException) as err:
            client.infer(
                "batch8", [_input("IN", np.ones((1, 4), np.float32), "FP32")], client_timeout=0.3
            )
        assert _status(err) == "StatusCode.DEADLINE_EXCEEDED"


@contextlib.contextmanager
def _expect_a_cancel(redis_url: str, model: str) -> Iterator[None]:
    """What runs inside must make the gateway publish a cancel for one of `model`'s requests."""
    redis = sync_client(redis_url)
    cancels = redis.pubsub()
    cancels.subscribe(keys.cancel_channel(model))
    try:
        yield
        message = None
        while message is None or message["type"] != "message":
            message = cancels.get_message(timeout=10)
            assert message is not None, f"no cancel published for {model}"
    finally:
        cancels.close()
        redis.close()


def test_compressed_requests_are_served(client: grpcclient.InferenceServerClient) -> None:
    x = np.zeros((2, 4), np.float32)
    for algorithm in ("gzip", "deflate"):
        result = client.infer("affine", [_input("X", x, "FP32")], compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("Y"), x * 2 + 1)


# -- stream -----------------------------------------------------------------------------------


def test_stream_answers_every_request_with_errors_in_band(
    client: grpcclient.InferenceServerClient,
) -> None:
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        x = np.arange(4, dtype=np.float32)[None, :]
        client.async_stream_infer("affine", [_input("X", x, "FP32")], request_id="a")
        client.async_stream_infer("affine", [_input("X", x[:, :3], "FP32")], request_id="bad")
        client.async_stream_infer("no_such_model", [_input("X", x, "FP32")], request_id="lost")
        client.async_stream_infer("affine", [_input("X", x + 1, "FP32")], request_id="b")
        answers = [results.get(timeout=30) for _ in range(4)]
        client.async_stream_infer("affine", [_input("X", x + 2, "FP32")], request_id="c")
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
        (stub.TraceSetting, pb.TraceSettingRequest()),
        (stub.LogSettings, pb.LogSettingsRequest()),
    ]
    codes = []
    for method, message in calls:
        with pytest.raises(grpc.RpcError) as err:
            method(message)
        codes.append(err.value.code())
    assert codes == [Status.UNIMPLEMENTED] * 2 + [Status.UNAVAILABLE] * 2


# -- a gateway with a token, a message limit and compressed responses -------------------------

TOKEN = "s3cret"
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def guarded(service: Service) -> Iterator[Service]:
    """A second gateway on the same Redis (the service's workers serve it)."""
    args = ["--redis-url", service.redis_url, "--auth-token", TOKEN]
    args += ["--max-body-bytes", str(LIMIT), "--grpc-infer-response-compression-level", "high"]
    gateway = start_sluice("gateway", args)
    yield gateway
    stop_service(gateway)


AUTH = {"authorization": f"Bearer {TOKEN}"}


def test_a_token_guards_every_rpc_but_the_probes(guarded: Service) -> None:
    x = np.ones((1, 4), np.float32)
    with grpcclient.InferenceServerClient(guarded.grpc_url) as client:
        assert client.is_server_live()
        assert client.is_server_ready()
        for call in (
            client.get_server_metadata,
            partial(client.get_model_metadata, "affine"),
            partial(client.infer, "affine", [_input("X", x, "FP32")]),
            partial(client.infer, "affine", [_input("X", x, "FP32")], headers={"x": "y"}),
            partial(client.get_model_config, "affine", headers={"authorization": "Bearer wrong"}),
        ):
            with pytest.raises(InferenceServerException) as err:
                call()
            assert _status(err) == "StatusCode.UNAUTHENTICATED"
        assert client.get_model_metadata("affine", headers=AUTH).name == "affine"
        y = client.infer("affine", [_input("X", x, "FP32")], headers=AUTH).as_numpy("Y")
        np.testing.assert_array_equal(y, x * 2 + 1)


def test_stream_needs_the_token_too(guarded: Service) -> None:
    with grpc.insecure_channel(guarded.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ModelStreamInfer(iter([pb.ModelInferRequest(model_name="affine")])))
        assert err.value.code() == Status.UNAUTHENTICATED


def test_a_message_over_the_limit_is_refused_even_compressed(guarded: Service) -> None:
    big = np.zeros((1, 2), np.object_)
    big[0, 0], big[0, 1] = b"\0" * LIMIT, b""
    inputs = _dtypes_inputs()
    inputs[-2] = _input("IN_BYTES", big, "BYTES")
    with grpcclient.InferenceServerClient(guarded.grpc_url) as client:
        for algorithm in (None, "gzip"):
            with pytest.raises(InferenceServerException) as err:
                client.infer("dtypes", inputs, headers=AUTH, compression_algorithm=algorithm)
            assert _status(err) == "StatusCode.RESOURCE_EXHAUSTED"


class _CountingProxy:
    """A TCP relay that counts the bytes the server sends: what is on the wire."""

    def __init__(self, target: str) -> None:
        import socket
        import threading

        self.from_server = 0
        self._target = target.rsplit(":", 1)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection((self._target[0], int(self._target[1])))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: Any, sink: Any, counted: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if counted:
                    self.from_server += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()

    def close(self) -> None:
        self._listener.close()


def _echo_bytes_through(target: str, headers: dict[str, str] | None) -> int:
    """Bytes the server sends for one dtypes echo of ~600 KB of zeros."""
    proxy = _CountingProxy(target)
    payload = np.array([[b"\0" * 300_000, b"\0" * 300_000]], np.object_)
    inputs = _dtypes_inputs()
    inputs[-2] = _input("IN_BYTES", payload, "BYTES")
    try:
        with grpcclient.InferenceServerClient(proxy.url) as client:
            result = client.infer("dtypes", inputs, headers=headers)
        assert result.as_numpy("OUT_BYTES")[0, 0] == payload[0, 0]
    finally:
        proxy.close()
    return proxy.from_server


def test_responses_are_compressed_at_the_level_asked(guarded: Service, service: Service) -> None:
    assert _echo_bytes_through(service.grpc_url, None) > 600_000
    assert _echo_bytes_through(guarded.grpc_url, AUTH) < 100_000


# -- cancellation and shutdown ----------------------------------------------------------------


def _when_queued(redis_url: str, model: str) -> Any:
    """A waiter that returns once a request more than now is on the model's stream."""
    redis = sync_client(redis_url)
    stream = keys.request_stream(model)
    before = redis.xlen(stream)

    def wait() -> None:
        try:
            wait_until(lambda: redis.xlen(stream) > before, f"a request queued for {model}")
        finally:
            redis.close()

    return wait


def _batch8_request() -> Any:
    tensor = pb.ModelInferRequest.InferInputTensor(name="IN", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents.extend([1, 2, 3, 4])
    return pb.ModelInferRequest(model_name="batch8", id="held", inputs=[tensor])


def test_cancelling_a_stream_cancels_its_queued_requests(stub: Any, service: Service) -> None:
    done_sending = threading.Event()

    def requests() -> Iterator[Any]:
        yield _batch8_request()
        done_sending.wait(30)  # the stream stays open until the call is cancelled

    queued = _when_queued(service.redis_url, "batch8")
    call = stub.ModelStreamInfer(requests())
    try:
        with _expect_a_cancel(service.redis_url, "batch8"):
            queued()
            call.cancel()
    finally:
        done_sending.set()


def test_a_stopping_gateway_answers_its_calls_in_flight(service: Service) -> None:
    gateway = start_sluice("gateway", ["--redis-url", service.redis_url])
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    try:
        with grpcclient.InferenceServerClient(gateway.grpc_url) as client:
            queued = _when_queued(service.redis_url, "batch8")
            x = np.ones((1, 4), np.float32)
            client.async_infer(
                "batch8",
                [_input("IN", x, "FP32")],
                lambda result, error: results.put((result, error)),
            )
            queued()
            gateway.process.terminate()
            result, error = results.get(timeout=60)
        assert error is None, error
        np.testing.assert_array_equal(result.as_numpy("OUT"), x * 2)
        assert gateway.process.wait(60) == 0
    finally:
        stop_service(gateway)


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
