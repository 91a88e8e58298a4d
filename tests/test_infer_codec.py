"""KServe v2 infer requests (shared/infer_codec.py): JSON data and the binary extension."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from sluice.shared.datatypes import (
    ELEMENT_SIZE,
    NUMPY_DTYPE,
    deserialize_bytes_elements,
    serialize_bytes_elements,
)
from sluice.shared.infer_codec import parse_infer
from tritonclient.http import _utils as triton_utils

from tests.infer_bodies import (
    SIG,
    binary_body,
    binary_input,
    fp32_input,
    json_body,
    signature,
    values,
)

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
