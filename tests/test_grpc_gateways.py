"""Gateways of their own through tritonclient.grpc, on the session service's Redis and workers:
one that wants a token, limits a message's size and compresses its responses (on each gRPC
server: the gateway's own HTTP/2 and grpcio's); one that stops with a call in flight; and a
stream cancelled with a request queued."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from sluice.shared import keys
from sluice.shared.redis_client import sync_client
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import Service, start_sluice, stop_service, wait_until
from tests.grpc_calls import dtypes_inputs, expect_a_cancel, grpc_input, status_of

Status = grpc.StatusCode


# -- a gateway with a token, a message limit and compressed responses -------------------------

TOKEN = "s3cret"
LIMIT = 1 << 20


@pytest.fixture(scope="module", params=["sluice", "grpcio"])
def guarded(service: Service, request: pytest.FixtureRequest) -> Iterator[Service]:
    """A second gateway on the same Redis (the service's workers serve it), on each of the
    servers --grpc-server chooses, which must answer alike."""
    args = ["--redis-url", service.redis_url, "--auth-token", TOKEN, "--grpc-server", request.param]
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
            partial(client.infer, "affine", [grpc_input("X", x, "FP32")]),
            partial(client.infer, "affine", [grpc_input("X", x, "FP32")], headers={"x": "y"}),
            partial(client.get_model_config, "affine", headers={"authorization": "Bearer wrong"}),
        ):
            with pytest.raises(InferenceServerException) as err:
                call()
            assert status_of(err) == "StatusCode.UNAUTHENTICATED"
        assert client.get_model_metadata("affine", headers=AUTH).name == "affine"
        y = client.infer("affine", [grpc_input("X", x, "FP32")], headers=AUTH).as_numpy("Y")
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
    inputs = dtypes_inputs()
    inputs[-2] = grpc_input("IN_BYTES", big, "BYTES")
    with grpcclient.InferenceServerClient(guarded.grpc_url) as client:
        for algorithm in (None, "gzip"):
            with pytest.raises(InferenceServerException) as err:
                client.infer("dtypes", inputs, headers=AUTH, compression_algorithm=algorithm)
            assert status_of(err) == "StatusCode.RESOURCE_EXHAUSTED"


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
    inputs = dtypes_inputs()
    inputs[-2] = grpc_input("IN_BYTES", payload, "BYTES")
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


def test_cancelling_a_stream_cancels_its_queued_requests(service: Service) -> None:
    done_sending = threading.Event()

    def requests() -> Iterator[Any]:
        yield _batch8_request()
        done_sending.wait(30)  # the stream stays open until the call is cancelled

    queued = _when_queued(service.redis_url, "batch8")
    with grpc.insecure_channel(service.grpc_url) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())
        try:
            with expect_a_cancel(service.redis_url, "batch8"):
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
                [grpc_input("IN", x, "FP32")],
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
