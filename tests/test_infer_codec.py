"""KServe v2 infer bodies (shared/infer_codec.py): JSON, binary extension, responses, errors."""

from __future__ import annotations

import gzip
import zlib
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.http import _utils as triton_utils

from shared.datatypes import (
    ELEMENT_SIZE,
    NUMPY_DTYPE,
    deserialize_bytes_elements,
    serialize_bytes_elements,
    wire_to_config,
)
from shared.errors import InvalidInput
from shared.infer_codec import ParsedInfer, decompress, encode_response, parse_infer
from shared.protocol import Tensor
from shared.signature import Signature


def signature(
    inputs: dict[str, tuple[str, list[int]]],
    outputs: dict[str, tuple[str, list[int]]] | None = None,
    max_batch_size: int = 8,
) -> Signature:
    """inputs/outputs: name -> (wire datatype, dims)."""

    def io(items: dict[str, tuple[str, list[int]]]) -> list[dict[str, Any]]:
        return [
            {"name": name, "data_type": wire_to_config(dt), "dims": dims}
            for name, (dt, dims) in items.items()
        ]

    return Signature.from_config(
        {
            "name": "m",
            "max_batch_size": max_batch_size,
            "input": io(inputs),
            "output": io(outputs or {"OUT": ("FP32", [4])}),
        }
    )


SIG = signature({"IN": ("FP32", [4])})


def binary_body(header: dict[str, Any], *blobs: bytes) -> tuple[bytes, int]:
    """A binary-extension body and its Inference-Header-Content-Length."""
    head = orjson.dumps(header)
    return head + b"".join(blobs), len(head)


def json_body(header: dict[str, Any]) -> bytes:
    return orjson.dumps(header)


def fp32_input(shape: list[int], data: Any, name: str = "IN") -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "shape": shape, "data": data}


def binary_input(name: str, datatype: str, shape: list[int], size: int) -> dict[str, Any]:
    return {
        "name": name,
        "datatype": datatype,
        "shape": shape,
        "parameters": {"binary_data_size": size},
    }


def values(t: Tensor) -> list[Any]:
    return np.frombuffer(t.data, dtype=NUMPY_DTYPE[t.datatype]).tolist()


# --- JSON requests -------------------------------------------------------------------------


def test_json_nested_data() -> None:
    body = json_body(
        {
            "id": "abc",
            "parameters": {"priority": 1},
            "inputs": [fp32_input([2, 4], [[1, 2, 3, 4], [5, 6, 7, 8.5]])],
        }
    )
    parsed = parse_infer(body, None, SIG)
    assert parsed.id == "abc"
    assert parsed.parameters == {"priority": 1}
    assert parsed.outputs is None
    assert parsed.binary_output is False
    (t,) = parsed.inputs
    assert (t.name, t.datatype, t.shape) == ("IN", "FP32", (2, 4))
    assert bytes(t.data) == np.array([1, 2, 3, 4, 5, 6, 7, 8.5], dtype="<f4").tobytes()


def test_json_flat_data_gives_the_same_bytes_as_nested() -> None:
    flat = parse_infer(json_body({"inputs": [fp32_input([2, 2], [1, 2, 3, 4])]}), None, SIG)
    nested = parse_infer(json_body({"inputs": [fp32_input([2, 2], [[1, 2], [3, 4]])]}), None, SIG)
    assert bytes(flat.inputs[0].data) == bytes(nested.inputs[0].data)
    assert values(flat.inputs[0]) == [1.0, 2.0, 3.0, 4.0]
    assert flat.id is None


@pytest.mark.parametrize(
    ("datatype", "data", "expected"),
    [
        ("BOOL", [True, False, True], b"\x01\x00\x01"),
        ("UINT8", [0, 7, 255], bytes([0, 7, 255])),
        ("INT8", [-128, 0, 127], np.array([-128, 0, 127], "<i1").tobytes()),
        ("UINT16", [1, 2, 65535], np.array([1, 2, 65535], "<u2").tobytes()),
        ("INT16", [-1, 0, 1], np.array([-1, 0, 1], "<i2").tobytes()),
        ("UINT32", [0, 1, 2**32 - 1], np.array([0, 1, 2**32 - 1], "<u4").tobytes()),
        ("INT32", [-(2**31), 0, 2**31 - 1], np.array([-(2**31), 0, 2**31 - 1], "<i4").tobytes()),
        ("UINT64", [0, 1, 2**64 - 1], np.array([0, 1, 2**64 - 1], "<u8").tobytes()),
        ("INT64", [-(2**63), 0, 2**63 - 1], np.array([-(2**63), 0, 2**63 - 1], "<i8").tobytes()),
        ("FP32", [0.5, -1, 3.25], np.array([0.5, -1, 3.25], "<f4").tobytes()),
        ("FP64", [0.1, -1, 1e300], np.array([0.1, -1, 1e300], "<f8").tobytes()),
        ("BYTES", ["a", "", "w\u00f6rld"], serialize_bytes_elements([b"a", b"", "w\u00f6rld"])),
    ],
)
def test_json_data_of_each_datatype(datatype: str, data: list[Any], expected: bytes) -> None:
    sig = signature({"X": (datatype, [3])})
    body = json_body(
        {"inputs": [{"name": "X", "datatype": datatype, "shape": [1, 3], "data": data}]}
    )
    (t,) = parse_infer(body, None, sig).inputs
    assert (t.datatype, t.shape) == (datatype, (1, 3))
    assert bytes(t.data) == expected


def test_json_request_from_tritonclient() -> None:
    a = httpclient.InferInput("A", [1, 3], "INT32")
    a.set_data_from_numpy(np.array([[1, -2, 3]], dtype=np.int32), binary_data=False)
    s = httpclient.InferInput("S", [2], "BYTES")
    s.set_data_from_numpy(np.array([b"x", b"yz"], dtype=np.object_), binary_data=False)
    out = httpclient.InferRequestedOutput("OUT", binary_data=False)
    body, json_size = triton_utils._get_inference_request(
        [a, s], "rid", [out], 0, False, False, 0, None, None
    )
    assert json_size is None
    sig = signature({"A": ("INT32", [3]), "S": ("BYTES", [2])}, max_batch_size=0)
    parsed = parse_infer(body, json_size, sig)
    assert parsed.id == "rid"
    assert parsed.outputs == {"OUT": False}
    assert values(parsed.inputs[0]) == [1, -2, 3]
    assert deserialize_bytes_elements(parsed.inputs[1].data) == [b"x", b"yz"]


# --- binary extension ----------------------------------------------------------------------


def sample_array(datatype: str) -> tuple[np.ndarray, bytes]:
    """A (1, 3) array of `datatype` and its wire bytes."""
    if datatype == "BYTES":
        items = [b"a", b"", b"\x00xyz"]
        return np.array([items], dtype=np.object_), serialize_bytes_elements(items)
    if datatype == "BF16":
        floats = np.array([[1.0, -2.5, 3.0]], dtype=np.float32)  # exact in bfloat16
        return floats, (floats.view(np.uint32) >> 16).astype("<u2").tobytes()
    if datatype == "BOOL":
        array = np.array([[True, False, True]])
        return array, array.tobytes()
    dtype = NUMPY_DTYPE[datatype]
    array = np.array([[1, 2, 3]], dtype=dtype)
    if dtype.kind == "f":
        array = np.array([[0.5, -1.5, 65504.0]], dtype=dtype)
    return array, array.tobytes()


ALL_DATATYPES = sorted(ELEMENT_SIZE)


@pytest.mark.parametrize("datatype", ALL_DATATYPES)
def test_binary_input_of_each_datatype(datatype: str) -> None:
    _, raw = sample_array(datatype)
    sig = signature({"X": (datatype, [3])})
    body, header_length = binary_body(
        {"inputs": [binary_input("X", datatype, [1, 3], len(raw))]}, raw
    )
    parsed = parse_infer(body, header_length, sig)
    (t,) = parsed.inputs
    assert (t.name, t.datatype, t.shape) == ("X", datatype, (1, 3))
    assert bytes(t.data) == raw
    # zero copy: a view into the request body
    assert isinstance(t.data, memoryview)
    assert t.data.obj is body


@pytest.mark.parametrize("datatype", ALL_DATATYPES)
def test_binary_request_from_tritonclient(datatype: str) -> None:
    array, raw = sample_array(datatype)
    if datatype == "BF16":
        # recent tritonclient (since r26.06) takes BF16 only as ml_dtypes.bfloat16
        ml_dtypes = pytest.importorskip("ml_dtypes")
        array = array.astype(ml_dtypes.bfloat16)
    infer_input = httpclient.InferInput("X", [1, 3], datatype)
    infer_input.set_data_from_numpy(array, binary_data=True)
    body, json_size = triton_utils._get_inference_request(
        [infer_input], None, None, 0, False, False, 0, None, None
    )
    assert json_size is not None
    parsed = parse_infer(body, json_size, signature({"X": (datatype, [3])}))
    assert bytes(parsed.inputs[0].data) == raw
    assert parsed.inputs[0].shape == (1, 3)


def test_mixed_json_and_binary_inputs_consume_binary_in_order() -> None:
    a = np.array([[1, 2, 3, 4]], dtype="<f4").tobytes()
    c = serialize_bytes_elements([b"hi", b"there"])
    sig = signature({"A": ("FP32", [4]), "B": ("INT32", [2]), "C": ("BYTES", [2])})
    body, header_length = binary_body(
        {
            "inputs": [
                binary_input("A", "FP32", [1, 4], len(a)),
                {"name": "B", "datatype": "INT32", "shape": [1, 2], "data": [[7, 8]]},
                binary_input("C", "BYTES", [1, 2], len(c)),
            ],
            "outputs": [{"name": "OUT", "parameters": {"binary_data": True}}],
        },
        a,
        c,
    )
    parsed = parse_infer(body, header_length, sig)
    assert [t.name for t in parsed.inputs] == ["A", "B", "C"]
    assert bytes(parsed.inputs[0].data) == a
    assert values(parsed.inputs[1]) == [7, 8]
    assert deserialize_bytes_elements(parsed.inputs[2].data) == [b"hi", b"there"]
    assert parsed.outputs == {"OUT": True}


def test_binary_data_output_parameter() -> None:
    body = json_body(
        {"parameters": {"binary_data_output": True}, "inputs": [fp32_input([4], [0] * 4)]}
    )
    parsed = parse_infer(body, None, SIG)
    assert parsed.binary_output is True
    assert parsed.parameters == {"binary_data_output": True}


def test_raw_binary_body() -> None:
    raw = np.array([1, 2, 3, 4], dtype="<f4").tobytes()
    parsed = parse_infer(raw, 0, SIG)
    (t,) = parsed.inputs
    assert (t.name, t.datatype, t.shape) == ("IN", "FP32", (1, 4))
    assert bytes(t.data) == raw
    assert parsed.binary_output is True
    assert (parsed.id, parsed.outputs, parsed.parameters) == (None, None, {})


def test_raw_binary_body_without_batching() -> None:
    sig = signature({"IN": ("INT32", [2])}, max_batch_size=0)
    (t,) = parse_infer(b"\x01\x00\x00\x00\x02\x00\x00\x00", 0, sig).inputs
    assert t.shape == (2,)


# --- errors --------------------------------------------------------------------------------


def expect_invalid(
    body: bytes, header_length: int | None, match: str, sig: Signature = SIG
) -> None:
    with pytest.raises(InvalidInput, match=match):
        parse_infer(body, header_length, sig)


FOUR = [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ([], "JSON object"),
        ({}, "'inputs' must be a non-empty list"),
        ({"inputs": []}, "'inputs' must be a non-empty list"),
        ({"inputs": {"name": "IN"}}, "'inputs' must be a non-empty list"),
        ({"inputs": ["IN"]}, r"inputs\[0\]: must be an object with a string 'name'"),
        ({"inputs": [{"name": 3}]}, r"inputs\[0\]"),
        ({"parameters": [1], "inputs": [fp32_input([1, 4], FOUR)]}, "'parameters'"),
        (
            {"inputs": [{"name": "IN", "datatype": "FP128", "shape": [1, 4], "data": FOUR}]},
            "input 'IN': unknown datatype 'FP128'",
        ),
        (
            {"inputs": [{"name": "IN", "datatype": "TYPE_FP32", "shape": [1, 4], "data": FOUR}]},
            "input 'IN': unknown datatype 'TYPE_FP32'",
        ),
        ({"inputs": [fp32_input("1,4", FOUR)]}, "input 'IN': 'shape'"),
        ({"inputs": [fp32_input([1, -4], FOUR)]}, "input 'IN': 'shape'"),
        ({"inputs": [fp32_input([1, 4.0], FOUR)]}, "input 'IN': 'shape'"),
        ({"inputs": [{"name": "IN", "datatype": "FP32", "data": FOUR}]}, "input 'IN': 'shape'"),
        (
            {"inputs": [fp32_input([1, 4], [1, 2, 3])]},
            r"input 'IN': 3 values in 'data' for shape \[1, 4\]",
        ),
        ({"inputs": [fp32_input([2, 4], [FOUR])]}, "input 'IN': 4 values"),
        (
            {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 4]}]},
            "input 'IN': has neither 'data' nor 'binary_data_size'",
        ),
        (
            {"inputs": [fp32_input([1, 4], ["a", "b", "c", "d"])]},
            "input 'IN': 'data' does not hold FP32",
        ),
        ({"inputs": [fp32_input([1, 4], [{}, 1, 2, 3])]}, "input 'IN': 'data' does not hold FP32"),
        (
            {"inputs": [{"name": "IN", "datatype": "UINT8", "shape": [1], "data": [256]}]},
            "input 'IN': 'data' does not hold UINT8",
        ),
        (
            {"inputs": [{"name": "IN", "datatype": "UINT32", "shape": [1], "data": [-1]}]},
            "input 'IN': 'data' does not hold UINT32",
        ),
        (
            {"inputs": [{"name": "IN", "datatype": "BF16", "shape": [1], "data": [1.0]}]},
            "input 'IN': BF16 data must be sent in binary",
        ),
        (
            {"inputs": [{"name": "IN", "datatype": "BOOL", "shape": [2], "data": [1, 0]}]},
            "input 'IN': BOOL 'data' must hold true/false",
        ),
        (
            {"inputs": [{"name": "IN", "datatype": "BYTES", "shape": [2], "data": ["a", 1]}]},
            "input 'IN': BYTES 'data' must hold strings",
        ),
        ({"id": 5, "inputs": [fp32_input([1, 4], FOUR)]}, "'id' must be a string"),
        (
            {"id": None, "outputs": {}, "inputs": [fp32_input([1, 4], FOUR)]},
            "'outputs' must be a list",
        ),
        ({"outputs": [{"nam": "OUT"}], "inputs": [fp32_input([1, 4], FOUR)]}, r"outputs\[0\]"),
    ],
)
def test_json_errors_name_the_field(header: Any, match: str) -> None:
    expect_invalid(json_body(header), None, match)


def test_malformed_json() -> None:
    expect_invalid(b'{"inputs": [', None, "malformed JSON")
    expect_invalid(b"\xff\xfe", None, "malformed JSON")
    expect_invalid(b"", None, "malformed JSON")
    expect_invalid(b'{"inputs": [{"name": "IN", "data": [NaN]}]}', None, "malformed JSON")


def test_malformed_json_header_in_binary_body() -> None:
    body = b'{"inputs": [}' + b"\0" * 16
    expect_invalid(body, 13, "malformed JSON")


FP32_ROW = np.array([[1, 2, 3, 4]], dtype="<f4").tobytes()


def test_binary_size_not_matching_the_shape() -> None:
    body, n = binary_body({"inputs": [binary_input("IN", "FP32", [1, 4], 12)]}, FP32_ROW[:12])
    expect_invalid(
        body, n, r"input 'IN': binary_data_size 12 does not match shape \[1, 4\] of FP32"
    )


def test_binary_past_the_end_of_the_body() -> None:
    body, n = binary_body({"inputs": [binary_input("IN", "FP32", [1, 4], 16)]}, FP32_ROW[:8])
    expect_invalid(body, n, "input 'IN': binary_data_size 16 runs past the end of the body")


def test_second_binary_input_past_the_end() -> None:
    sig = signature({"A": ("FP32", [4]), "B": ("FP32", [4])})
    header = {
        "inputs": [
            binary_input("A", "FP32", [1, 4], 16),
            binary_input("B", "FP32", [1, 4], 16),
        ]
    }
    body, n = binary_body(header, FP32_ROW, FP32_ROW[:15])
    expect_invalid(body, n, "input 'B': binary_data_size 16 runs past the end", sig)


def test_leftover_binary_bytes() -> None:
    body, n = binary_body({"inputs": [binary_input("IN", "FP32", [1, 4], 16)]}, FP32_ROW, b"\0" * 4)
    expect_invalid(body, n, "binary data in the body is 20 bytes but inputs declare 16")


def test_binary_bytes_after_a_pure_json_header() -> None:
    body, n = binary_body({"inputs": [fp32_input([1, 4], FOUR)]}, b"\0\0")
    expect_invalid(body, n, "binary data in the body is 2 bytes but inputs declare 0")


def test_header_length_past_the_body() -> None:
    body = json_body({"inputs": [fp32_input([1, 4], FOUR)]})
    expect_invalid(body, len(body) + 1, "Inference-Header-Content-Length")


@pytest.mark.parametrize("size", [-1, "16", 1.5])
def test_bad_binary_data_size(size: Any) -> None:
    header = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 4]}]}
    header["inputs"][0]["parameters"] = {"binary_data_size": size}
    body, n = binary_body(header, FP32_ROW)
    expect_invalid(body, n, "input 'IN': 'binary_data_size' must be a non-negative integer")


def test_bytes_binary_with_wrong_element_count() -> None:
    raw = serialize_bytes_elements([b"a", b"b"])
    sig = signature({"S": ("BYTES", [3])})
    body, n = binary_body({"inputs": [binary_input("S", "BYTES", [1, 3], len(raw))]}, raw)
    expect_invalid(body, n, r"input 'S': 2 BYTES elements for shape \[1, 3\]", sig)


def test_truncated_bytes_binary() -> None:
    raw = serialize_bytes_elements([b"abcdef"])[:-2]
    sig = signature({"S": ("BYTES", [1])})
    body, n = binary_body({"inputs": [binary_input("S", "BYTES", [1, 1], len(raw))]}, raw)
    expect_invalid(body, n, "input 'S': malformed BYTES data", sig)


def test_raw_binary_needs_exactly_one_input() -> None:
    sig = signature({"A": ("FP32", [4]), "B": ("FP32", [4])})
    expect_invalid(FP32_ROW, 0, "exactly one input; 'm' has 2", sig)


def test_raw_binary_needs_fixed_dims() -> None:
    sig = signature({"IN": ("FP32", [-1])})
    expect_invalid(FP32_ROW, 0, "input 'IN' has variable dims", sig)


# JSON values of the wrong JSON type that are accepted instead of being refused (see the report).
@pytest.mark.parametrize(
    ("item", "match"),
    [
        pytest.param(fp32_input([True, 4], FOUR), "'shape'", id="bool-in-shape"),
        pytest.param(fp32_input([1], [None]), "FP32", id="null-as-fp32"),
        pytest.param(fp32_input([2], ["1.5", "2"]), "FP32", id="numeric-strings-as-fp32"),
        pytest.param(
            {"name": "IN", "datatype": "INT32", "shape": [1], "data": [1.5]},
            "INT32",
            id="float-as-int32",
        ),
        pytest.param(
            {"name": "IN", "datatype": "INT32", "shape": [1], "data": [True]},
            "INT32",
            id="bool-as-int32",
        ),
    ],
)
def test_wrongly_typed_json_values_are_refused(item: dict[str, Any], match: str) -> None:
    expect_invalid(json_body({"inputs": [item]}), None, match, signature({"IN": ("FP32", [])}))


def test_binary_data_size_true_is_refused() -> None:
    header = {"inputs": [binary_input("IN", "UINT8", [1], 1)]}
    header["inputs"][0]["parameters"]["binary_data_size"] = True
    body, n = binary_body(header, b"\x07")
    expect_invalid(
        body, n, "'binary_data_size'", signature({"IN": ("UINT8", [1])}, max_batch_size=0)
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


def test_decompress_gzip() -> None:
    assert decompress(gzip.compress(PAYLOAD), "gzip") == PAYLOAD


def test_decompress_deflate() -> None:
    assert decompress(zlib.compress(PAYLOAD), "deflate") == PAYLOAD


@pytest.mark.parametrize("encoding", [None, "", "identity"])
def test_no_encoding_returns_the_body_unchanged(encoding: str | None) -> None:
    assert decompress(PAYLOAD, encoding) is PAYLOAD


def test_unsupported_encoding() -> None:
    with pytest.raises(InvalidInput, match="unsupported Content-Encoding 'br'"):
        decompress(PAYLOAD, "br")


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_corrupt_compressed_body(encoding: str) -> None:
    with pytest.raises(InvalidInput, match=f"body is not valid {encoding}"):
        decompress(b"definitely not compressed", encoding)
