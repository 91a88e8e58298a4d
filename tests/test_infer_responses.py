"""KServe v2 infer responses and Content-Encoding of bodies (shared/infer_codec.py)."""

from __future__ import annotations

import gzip
import zlib

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from sluice.shared.datatypes import serialize_bytes_elements
from sluice.shared.errors import InvalidInput
from sluice.shared.infer_codec import ParsedInfer, decompress, encode_response, parse_infer
from sluice.shared.protocol import Tensor

from tests.infer_bodies import (
    FOUR,
    SIG,
    fp32_input,
    json_body,
)

# --- responses -----------------------------------------------------------------------------


def parsed_request(
    request_id: str | None = None,
    binary_output: bool = False,
    outputs: dict[str, bool | None] | None = None,
) -> ParsedInfer:
    return ParsedInfer(request_id, {}, [], outputs, binary_output)


def out(name: str, datatype: str, array: np.ndarray) -> Tensor:
    return Tensor(name, datatype, tuple(array.shape), array.tobytes())


BF16_BITS = (np.array([1.0, -2.5], dtype=np.float32).view(np.uint32) >> 16).astype("<u2")
OUTPUTS = [
    out("F32", "FP32", np.array([[0.5, -1.25]], dtype="<f4")),
    out("I64", "INT64", np.array([[2**40, -3]], dtype="<i8")),
    out("B", "BOOL", np.array([[True, False]])),
    out("H", "FP16", np.array([[1.5, -0.25]], dtype="<f2")),
    Tensor("BF", "BF16", (1, 2), BF16_BITS.tobytes()),
    Tensor("S", "BYTES", (1, 2), serialize_bytes_elements([b"cat", "d\u00f6g"])),
    out("U8", "UINT8", np.array([[0, 255]], dtype="<u1")),
]
JSON_DATA = {
    "F32": [0.5, -1.25],
    "I64": [2**40, -3],
    "B": [True, False],
    "H": [1.5, -0.25],
    "BF": [1.0, -2.5],
    "S": ["cat", "d\u00f6g"],
    "U8": [0, 255],
}


def test_json_response() -> None:
    body, header_length = encode_response("m", 3, parsed_request("req-7"), OUTPUTS)
    assert header_length is None
    assert isinstance(body, bytes)
    decoded = orjson.loads(body)
    assert decoded["model_name"] == "m"
    assert decoded["model_version"] == "3"
    assert decoded["id"] == "req-7"
    assert [o["name"] for o in decoded["outputs"]] == list(JSON_DATA)
    for item in decoded["outputs"]:
        assert item["data"] == JSON_DATA[item["name"]]
        assert item["shape"] == [1, 2]
        assert "parameters" not in item
    assert {o["name"]: o["datatype"] for o in decoded["outputs"]}["BF"] == "BF16"


def test_response_without_id_does_not_invent_one() -> None:
    body, _ = encode_response("m", 1, parsed_request(None), OUTPUTS[:1])
    assert isinstance(body, bytes)
    assert "id" not in orjson.loads(body)


def join(parts: bytes | list[bytes | memoryview]) -> bytes:
    return parts if isinstance(parts, bytes) else b"".join(bytes(p) for p in parts)


def test_binary_response_for_every_output() -> None:
    parts, header_length = encode_response("m", 1, parsed_request("r", binary_output=True), OUTPUTS)
    assert header_length is not None
    assert isinstance(parts, list)
    body = join(parts)
    header = orjson.loads(body[:header_length])
    assert header["id"] == "r"
    sizes = [o["parameters"]["binary_data_size"] for o in header["outputs"]]
    assert sizes == [len(t.data) for t in OUTPUTS]
    assert all("data" not in o for o in header["outputs"])
    assert body[header_length:] == b"".join(bytes(t.data) for t in OUTPUTS)

    result = httpclient.InferResult.from_response_body(body, header_length=header_length)
    np.testing.assert_array_equal(result.as_numpy("F32"), [[0.5, -1.25]])
    np.testing.assert_array_equal(result.as_numpy("I64"), [[2**40, -3]])
    np.testing.assert_array_equal(result.as_numpy("B"), [[True, False]])
    np.testing.assert_array_equal(result.as_numpy("H"), np.array([[1.5, -0.25]], dtype=np.float16))
    np.testing.assert_array_equal(result.as_numpy("BF"), [[1.0, -2.5]])
    assert result.as_numpy("S").tolist() == [[b"cat", "d\u00f6g".encode()]]
    np.testing.assert_array_equal(result.as_numpy("U8"), [[0, 255]])
    assert result.get_response()["model_name"] == "m"


def test_per_output_binary_data_overrides_the_request_level_setting() -> None:
    request = parsed_request(binary_output=True, outputs={"F32": False, "S": None, "U8": True})
    parts, header_length = encode_response("m", 1, request, [OUTPUTS[0], OUTPUTS[5], OUTPUTS[6]])
    assert header_length is not None
    body = join(parts)
    header = orjson.loads(body[:header_length])
    f32, s, u8 = header["outputs"]
    assert f32["data"] == [0.5, -1.25]
    assert s["parameters"] == {"binary_data_size": len(OUTPUTS[5].data)}
    assert u8["parameters"] == {"binary_data_size": 2}
    assert body[header_length:] == bytes(OUTPUTS[5].data) + b"\x00\xff"
    result = httpclient.InferResult.from_response_body(body, header_length=header_length)
    np.testing.assert_array_equal(result.as_numpy("F32"), [[0.5, -1.25]])
    np.testing.assert_array_equal(result.as_numpy("U8"), [[0, 255]])


def test_per_output_binary_data_true_without_request_level_setting() -> None:
    request = parsed_request(outputs={"F32": True, "U8": False})
    parts, header_length = encode_response("m", 1, request, [OUTPUTS[0], OUTPUTS[6]])
    assert header_length is not None
    body = join(parts)
    header = orjson.loads(body[:header_length])
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 8}
    assert header["outputs"][1]["data"] == [0, 255]
    assert body[header_length:] == OUTPUTS[0].data


def test_response_from_a_parsed_request_keeps_its_output_choices() -> None:
    body = json_body(
        {
            "id": "x1",
            "parameters": {"binary_data_output": True},
            "inputs": [fp32_input([1, 4], FOUR)],
            "outputs": [{"name": "U8", "parameters": {"binary_data": False}}, {"name": "F32"}],
        }
    )
    request = parse_infer(body, None, SIG)
    parts, header_length = encode_response("m", 2, request, [OUTPUTS[0], OUTPUTS[6]])
    assert header_length is not None
    response = join(parts)
    header = orjson.loads(response[:header_length])
    assert header["id"] == "x1"
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 8}
    assert header["outputs"][1]["data"] == [0, 255]


def test_binary_output_from_memoryview_data() -> None:
    array = np.array([1.0, 2.0], dtype="<f8")
    tensor = Tensor("D", "FP64", (2,), memoryview(array.tobytes()))
    parts, header_length = encode_response("m", 1, parsed_request(binary_output=True), [tensor])
    assert header_length is not None
    body = join(parts)
    assert orjson.loads(body[:header_length])["outputs"][0]["parameters"] == {
        "binary_data_size": 16
    }
    result = httpclient.InferResult.from_response_body(body, header_length=header_length)
    np.testing.assert_array_equal(result.as_numpy("D"), array)


# --- Content-Encoding ----------------------------------------------------------------------


PAYLOAD = b'{"inputs": []}' * 50
LIMIT = len(PAYLOAD)


def test_decompress_gzip() -> None:
    assert decompress(gzip.compress(PAYLOAD), "gzip", LIMIT) == PAYLOAD


def test_decompress_deflate() -> None:
    assert decompress(zlib.compress(PAYLOAD), "deflate", LIMIT) == PAYLOAD


@pytest.mark.parametrize("encoding", [None, "", "identity"])
def test_no_encoding_returns_the_body_unchanged(encoding: str | None) -> None:
    assert decompress(PAYLOAD, encoding, LIMIT) is PAYLOAD


def test_unsupported_encoding() -> None:
    with pytest.raises(InvalidInput, match="unsupported Content-Encoding 'br'"):
        decompress(PAYLOAD, "br", LIMIT)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_corrupt_compressed_body(encoding: str) -> None:
    with pytest.raises(InvalidInput, match=f"body is not valid {encoding}"):
        decompress(b"definitely not compressed", encoding, LIMIT)
