"""Bad KServe v2 infer bodies (shared/infer_codec.py): refused with a message naming the field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from sluice.shared.datatypes import serialize_bytes_elements
from sluice.shared.errors import InvalidInput
from sluice.shared.infer_codec import parse_infer
from sluice.shared.signature import Signature, validate_inputs

from tests.infer_bodies import (
    FOUR,
    SIG,
    binary_body,
    binary_input,
    fp32_input,
    json_body,
    signature,
)


def expect_invalid(
    body: bytes, header_length: int | None, match: str, sig: Signature = SIG
) -> None:
    with pytest.raises(InvalidInput, match=match):
        parse_infer(body, header_length, sig)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ([], "JSON object"),
        ({}, "Unable to parse 'inputs': attempt to access non-existing object member 'inputs'"),
        ({"inputs": []}, "'inputs' must be a non-empty list"),
        ({"inputs": {"name": "IN"}}, "'inputs' must be a non-empty list"),
        ({"inputs": ["IN"]}, r"inputs\[0\]: must be an object with a string 'name'"),
        ({"inputs": [{"name": 3}]}, r"inputs\[0\]"),
        ({"parameters": [1], "inputs": [fp32_input([1, 4], FOUR)]}, "'parameters'"),
        (
            {"parameters": {"sequence_id": -1}, "inputs": [fp32_input([1, 4], FOUR)]},
            "Unable to parse 'sequence_id': attempt to access JSON non-string as string",
        ),
        (
            {"parameters": {"sequence_id": 1.5}, "inputs": [fp32_input([1, 4], FOUR)]},
            "Unable to parse 'sequence_id'",
        ),
        (
            {"parameters": {"sequence_start": 1}, "inputs": [fp32_input([1, 4], FOUR)]},
            "Unable to parse 'sequence_start': attempt to access JSON non-boolean as boolean",
        ),
        (
            {"parameters": {"sequence_end": "true"}, "inputs": [fp32_input([1, 4], FOUR)]},
            "Unable to parse 'sequence_end'",
        ),
        (
            {"inputs": [{"name": "IN", "datatype": "FP128", "shape": [1, 4], "data": FOUR}]},
            "invalid datatype for input IN",
        ),
        (
            {"inputs": [{"name": "IN", "datatype": "TYPE_FP32", "shape": [1, 4], "data": FOUR}]},
            "invalid datatype for input IN",
        ),
        (
            {"inputs": [{"name": "IN", "datatype": [], "shape": [1, 4], "data": FOUR}]},
            "invalid datatype for input IN",
        ),
        ({"inputs": [fp32_input("1,4", FOUR)]}, "Unable to parse 'shape': attempt to access JSON"),
        ({"inputs": [fp32_input([1, -4], FOUR)]}, "input 'IN': 'shape'"),
        ({"inputs": [fp32_input([1, 4.0], FOUR)]}, "input 'IN': 'shape'"),
        ({"inputs": [{"name": "IN", "datatype": "FP32", "data": FOUR}]}, "Unable to parse 'shape'"),
        (
            {"inputs": [fp32_input([1, 4], [1, 2, 3])]},
            "Unable to parse 'data': Shape does not match true shape of 'data' field",
        ),
        ({"inputs": [fp32_input([2, 4], [FOUR])]}, "Shape does not match true shape"),
        (
            {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 4]}]},
            "Input must set only one of the following fields: 'data', 'binary_data_size' in "
            "'parameters', 'shared_memory_region' in 'parameters'. But no field is set",
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


BAD_JSON = "failed to parse the request JSON buffer: "  # Triton's text


def test_malformed_json() -> None:
    expect_invalid(b'{"inputs": [', None, BAD_JSON)
    expect_invalid(b"\xff\xfe", None, BAD_JSON)
    expect_invalid(b"", None, BAD_JSON)
    expect_invalid(b'{"inputs": [{"name": "IN", "data": [NaN]}]}', None, BAD_JSON)


def test_malformed_json_header_in_binary_body() -> None:
    body = b'{"inputs": [}' + b"\0" * 16
    expect_invalid(body, 13, BAD_JSON)


FP32_ROW = np.array([[1, 2, 3, 4]], dtype="<f4").tobytes()


def test_binary_size_not_matching_the_shape() -> None:
    """The codec takes the bytes; validate_inputs names the mismatch against the model."""
    body, n = binary_body({"inputs": [binary_input("IN", "FP32", [1, 4], 12)]}, FP32_ROW[:12])
    parsed = parse_infer(body, n, SIG)
    with pytest.raises(InvalidInput) as caught:
        validate_inputs(SIG, parsed.inputs)
    assert caught.value.message == (
        "[request id: <id_unknown>] input byte size mismatch for input 'IN' for model "
        f"'{SIG.name}'. Expected 16, got 12"
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
    expect_invalid(
        body, len(body) + 1, rf"inference header size should be in range \(0, {len(body)}\)"
    )


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
