"""The gateway's own HTTP/2 for gRPC (gateway/grpc_h2), at what tritonclient's calls do not
reach: messages larger than the flow-control windows both ways, an unknown method, and
clients that do not speak HTTP/2 as it is written."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import hpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import Service, serving_alone

CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
"""

MODEL = """
class Model:
    def __init__(self, context):
        pass

    def infer(self, inputs):
        return {"OUT": inputs["IN"]}
"""

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0, 1, 3, 4, 7
END_HEADERS = 0x4


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    repo = tmp_path_factory.mktemp("h2_repo")
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(CONFIG)
    (repo / "echo" / "1" / "model.py").write_text(MODEL)
    with serving_alone(Path(repo)) as service:
        yield service


def test_messages_larger_than_every_window_cross_both_ways(echo: Service) -> None:
    """6 MiB each way: past the 1 MiB stream window the gateway grants, the client's 64 KiB
    default, and 16 KiB frames."""
    client = grpcclient.InferenceServerClient(echo.grpc_url)
    values = np.arange(1_500_000, dtype=np.float32)
    tensor = grpcclient.InferInput("IN", [len(values)], "FP32")
    tensor.set_data_from_numpy(values)
    for _ in range(2):  # the connection's windows are granted back after the first
        result = client.infer("echo", [tensor])
        assert np.array_equal(result.as_numpy("OUT"), values)


def test_an_unknown_method_is_unimplemented(echo: Service) -> None:
    with grpc.insecure_channel(echo.grpc_url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/NoSuchCall")
        with pytest.raises(grpc.RpcError) as raised:
            call(b"", timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _goaway_code(data: bytes) -> int | None:
    """The error code of the first GOAWAY among the frames in `data`, if any."""
    position = 0
    while len(data) - position >= 9:
        length = int.from_bytes(data[position : position + 3], "big")
        kind = data[position + 3]
        payload = data[position + 9 : position + 9 + length]
        if kind == GOAWAY and len(payload) >= 8:
            return int(struct.unpack(">II", payload[:8])[1])
        position += 9 + length
    return None


def _answer_to(echo: Service, data: bytes) -> bytes:
    """What the gRPC port sends back to `data` before it closes the connection."""
    host, port = echo.grpc_url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_a_client_that_is_not_http2_is_closed_with_a_protocol_error(echo: Service) -> None:
    answer = _answer_to(echo, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _goaway_code(answer) == 0x1  # PROTOCOL_ERROR


def test_a_frame_past_the_advertised_size_closes_the_connection(echo: Service) -> None:
    too_big = ((16 << 20) - 1).to_bytes(3, "big") + bytes([0, 0]) + (1).to_bytes(4, "big")
    answer = _answer_to(echo, PREFACE + too_big)
    assert _goaway_code(answer) == 0x6  # FRAME_SIZE_ERROR


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    head = len(payload).to_bytes(3, "big") + bytes([kind, flags])
    return head + stream_id.to_bytes(4, "big") + payload


def _call_headers(encoder: hpack.Encoder, echo: Service, method: str) -> bytes:
    return encoder.encode(
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", f"/inference.GRPCInferenceService/{method}"),
            (":authority", echo.grpc_url),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
    )


def test_a_client_past_a_streams_window_is_closed(echo: Service) -> None:
    """A stream call's body is granted only as its requests are taken: a client that sends
    past the 1 MiB window anyway breaks flow control."""
    headers = _call_headers(hpack.Encoder(), echo, "ModelStreamInfer")
    message_start = b"\x00" + (60 << 20).to_bytes(4, "big")  # one message, never complete
    body = message_start + b"x" * (600 << 10)
    data = PREFACE + _frame(SETTINGS, 0, 0) + _frame(HEADERS, END_HEADERS, 1, headers)
    data += _frame(DATA, 0, 1, body) + _frame(DATA, 0, 1, b"x" * (600 << 10))
    assert _goaway_code(_answer_to(echo, data)) == 0x3  # FLOW_CONTROL_ERROR


def test_a_client_resetting_streams_by_the_thousand_is_sent_away(echo: Service) -> None:
    """HTTP/2's rapid reset: each stream opened starts a call, each reset ends it at once."""
    encoder = hpack.Encoder()
    frames = [PREFACE, _frame(SETTINGS, 0, 0)]
    for stream_id in range(1, 2401, 2):  # 1,200 client streams
        frames.append(
            _frame(HEADERS, END_HEADERS, stream_id, _call_headers(encoder, echo, "ModelInfer"))
        )
        frames.append(_frame(RST_STREAM, 0, stream_id, (8).to_bytes(4, "big")))
    assert _goaway_code(_answer_to(echo, b"".join(frames))) == 0xB  # ENHANCE_YOUR_CALM
