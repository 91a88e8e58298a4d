"""Streams against clients that do not read: a gRPC `ModelStreamInfer` stops reading requests
past its bound, a decoupled model's responses wait for the client within their bound, and a
client that falls further behind has its request stopped, never its responses buffered
without end (gRPC and HTTP generate_stream alike)."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import HERE, Service, start_service, stop_service, wait_until
from tests.grpc_calls import expect_a_cancel

MAX_REQUESTS = 4
MAX_QUEUED_BYTES = 1 << 20
MAX_HELD_BYTES = 8 << 20
#: a response and request size that fills a non-reading client's HTTP/2 window at once.
PAYLOAD = 64 << 10


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    repo = tmp_path_factory.mktemp("backpressure") / "models"
    shutil.copytree(HERE / "backpressure_repo", repo)
    with EmbeddedRedis() as redis:
        svc = start_service(
            [
                *("--model-repository", str(repo), "--redis-url", redis.url),
                *("--grpc-stream-max-requests", str(MAX_REQUESTS)),
                *("--grpc-stream-max-queued-bytes", str(MAX_QUEUED_BYTES)),
                *("--stream-max-held-bytes", str(MAX_HELD_BYTES)),
            ]
        )
        try:
            yield svc
        finally:
            stop_service(svc)


@pytest.fixture
def stub(service: Service) -> Iterator[Any]:
    with grpc.insecure_channel(service.grpc_url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def gauge(service: Service, name: str) -> float:
    """One of the gateway's own gauges, as its metrics port shows it now."""
    with urllib.request.urlopen(f"http://{service.metrics_url}/metrics") as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} is not on the metrics port")


def pad_request(index: int) -> Any:
    request = pb.ModelInferRequest(model_name="pad", id=f"r{index}")
    request.inputs.add(name="IN", datatype="UINT8", shape=[PAYLOAD])
    request.raw_input_contents.append(bytes([index % 256]) * PAYLOAD)
    return request


def spew_request(count: int, size: int) -> Any:
    request = pb.ModelInferRequest(model_name="spew", id="s")
    for name, value in (("N", count), ("SIZE", size)):
        request.inputs.add(name=name, datatype="INT32", shape=[1])
        request.raw_input_contents.append(np.array([value], np.int32).tobytes())
    return request


class Sender:
    """A request iterator that counts what grpc took from it."""

    def __init__(self, requests: list[Any]) -> None:
        self.requests = requests
        self.taken = 0
        self.lock = threading.Lock()

    def __iter__(self) -> Iterator[Any]:
        for request in self.requests:
            with self.lock:
                self.taken += 1
            yield request


def test_an_unread_stream_holds_at_most_its_bound_and_loses_nothing(
    stub: Any, service: Service
) -> None:
    count = 40
    sender = Sender([pad_request(i) for i in range(count)])
    responses = stub.ModelStreamInfer(iter(sender))
    name = "sluice_grpc_stream_requests_in_flight"
    wait_until(lambda: gauge(service, name) == MAX_REQUESTS, "the stream's bound reached")
    # grpc took more from the client than the gateway holds, and the gateway holds its bound
    assert sender.taken > MAX_REQUESTS
    assert gauge(service, name + "_max") == MAX_REQUESTS
    answers = list(responses)  # the client reads: every request is answered, once
    assert sorted(a.infer_response.id for a in answers) == sorted(f"r{i}" for i in range(count))
    assert all(a.error_message == "" for a in answers)
    for answer in answers:
        index = int(answer.infer_response.id[1:])
        assert answer.infer_response.raw_output_contents[0] == bytes([index % 256]) * PAYLOAD
    assert gauge(service, name + "_max") == MAX_REQUESTS
    assert gauge(service, name) == 0


def test_a_read_decoupled_stream_gets_every_response_within_the_byte_bound(
    stub: Any, service: Service
) -> None:
    """More responses than the queue holds: they wait for the client, and all arrive."""
    count = 48  # 3 MiB: past the queue's bound, within the held bound even if the client lags
    answers = list(stub.ModelStreamInfer(iter([spew_request(count, PAYLOAD)])))
    assert [a.error_message for a in answers] == [""] * count
    contents = [a.infer_response.raw_output_contents[0] for a in answers]
    assert contents == [bytes([k]) * PAYLOAD for k in range(count)]
    # never more queued for the client than the bound, give or take the one message let in
    assert gauge(service, "sluice_grpc_stream_queued_bytes_max") <= MAX_QUEUED_BYTES + 2 * PAYLOAD


def test_a_decoupled_request_whose_client_stops_reading_is_stopped(
    stub: Any, service: Service
) -> None:
    count = 1000  # 62 MiB, far past what the gateway holds for a client (8 MiB)
    with expect_a_cancel(service.redis_url, "spew"):
        responses = stub.ModelStreamInfer(iter([spew_request(count, PAYLOAD)]))
    answers = list(responses)
    *delivered, last = answers
    assert len(delivered) < count
    assert all(a.error_message == "" for a in delivered)
    assert "not read" in last.error_message
    contents = [a.infer_response.raw_output_contents[0] for a in delivered]
    assert contents == [bytes([k % 256]) * PAYLOAD for k in range(len(delivered))]


def test_generate_stream_to_a_client_that_stops_reading_is_stopped(service: Service) -> None:
    host, port = service.http_url.split(":")
    count = 2000  # 16 MiB, in bursts off the reply stream of at most 2 MiB
    body = json.dumps({"N": count, "SIZE": 8 << 10}).encode()
    head = (
        f"POST /v2/models/spew/generate_stream HTTP/1.1\r\nhost: {host}\r\n"
        f"content-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        with expect_a_cancel(service.redis_url, "spew"):
            client.connect((host, int(port)))
            client.sendall(head + body)
        received = bytearray()
        while chunk := client.recv(1 << 20):
            received += chunk
    head, _, rest = bytes(received).partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head:
        rest = _unchunked(rest)
    if head.startswith(b"HTTP/1.1 400"):  # stopped before its first response was sent
        assert "not read" in json.loads(rest)["error"]
        return
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    events = [json.loads(e.removeprefix(b"data: ")) for e in rest.split(b"\n\n") if e]
    *delivered, last = events
    assert len(delivered) < count
    assert [d["OUT"][0] for d in delivered] == [k % 256 for k in range(len(delivered))]
    assert "not read" in last["error"]


def _unchunked(body: bytes) -> bytes:
    """The data of a chunked body, as far as it came."""
    data = bytearray()
    while body:
        size, _, body = body.partition(b"\r\n")
        data += body[: int(size, 16)]
        body = body[int(size, 16) + 2 :]
    return bytes(data)
