"""Request validation against a model signature (shared/signature.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from sluice.shared.datatypes import serialize_bytes_elements
from sluice.shared.errors import InvalidInput
from sluice.shared.protocol import Tensor
from sluice.shared.signature import BATCH_DIM_NOTE, IOSpec, Signature, validate_inputs

CONFIG: dict[str, Any] = {
    "name": "m",
    "max_batch_size": 8,
    "input": [
        {"name": "A", "data_type": "TYPE_FP32", "dims": [4]},
        {"name": "B", "data_type": "TYPE_INT64", "dims": [-1, 2]},
        {"name": "S", "data_type": "TYPE_STRING", "dims": [1]},
    ],
    "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}],
}
SIG = Signature.from_config(CONFIG)


def fp32(shape: tuple[int, ...], name: str = "A") -> Tensor:
    return Tensor(name, "FP32", shape, np.zeros(shape, dtype="<f4").tobytes())


def int64(shape: tuple[int, ...], name: str = "B") -> Tensor:
    return Tensor(name, "INT64", shape, np.zeros(shape, dtype="<i8").tobytes())


def strings(batch: int, name: str = "S") -> Tensor:
    return Tensor(name, "BYTES", (batch, 1), serialize_bytes_elements([b"x"] * batch))


def good(batch: int = 3) -> list[Tensor]:
    return [fp32((batch, 4)), int64((batch, 5, 2)), strings(batch)]


def invalid(inputs: list[Tensor], sig: Signature = SIG) -> str:
    with pytest.raises(InvalidInput) as info:
        validate_inputs(sig, inputs)
    assert info.value.http_status == 400
    return info.value.message


def test_from_config() -> None:
    assert SIG.name == "m"
    assert SIG.max_batch_size == 8
    assert SIG.inputs == (
        IOSpec("A", "FP32", (4,)),
        IOSpec("B", "INT64", (-1, 2)),
        IOSpec("S", "BYTES", (1,)),
    )
    assert SIG.output_names() == ("OUT",)
    assert SIG.full_shape(SIG.inputs[1]) == [-1, -1, 2]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_returns_the_batch_size(batch: int) -> None:
    assert validate_inputs(SIG, good(batch)) == batch


def test_order_of_inputs_does_not_matter() -> None:
    assert validate_inputs(SIG, list(reversed(good(2)))) == 2


# Triton 2.51's texts, read off tritonserver on the same requests
AT = "[request id: <id_unknown>] "
MISMATCH = "input byte size mismatch for input '{}' for model '{}'. Expected {}, got {}"


def test_missing_input() -> None:
    message = invalid(good()[:2])
    assert message == (
        f"{AT}expected 3 inputs but got 2 inputs for model 'm'. Got input(s) ['A','B'], but "
        "missing required input(s) ['S']. Please provide all required input(s)."
    )


def test_unexpected_input() -> None:
    message = invalid([*good(), fp32((3, 4), name="EXTRA")])
    assert message == (  # Triton prints an empty list of names as a lone ']'
        f"{AT}expected 3 inputs but got 4 inputs for model 'm'. Got input(s) "
        "['A','B','S','EXTRA'], but missing required input(s) ]. Please provide all required "
        "input(s)."
    )
    message = invalid([*good()[:2], fp32((3, 4), name="EXTRA")])
    assert message == "unexpected inference input 'EXTRA' for model 'm'"


def test_duplicate_input_name() -> None:
    assert invalid([*good(), fp32((3, 4))]) == f"{AT}input 'A' already exists in request"


def test_request_id_names_the_request() -> None:
    with pytest.raises(InvalidInput) as caught:
        validate_inputs(SIG, [*good(), fp32((3, 4))], "r-7")
    assert caught.value.message == "[request id: r-7] input 'A' already exists in request"


def test_wrong_datatype() -> None:
    inputs = good()
    inputs[0] = Tensor("A", "FP64", (3, 4), np.zeros((3, 4), dtype="<f8").tobytes())
    assert invalid(inputs) == (
        f"{AT}inference input 'A' data-type is 'FP64', but model 'm' expects 'FP32'"
    )


def _shape_error(name: str, expected: str, got: str, model: str = "m", note: bool = True) -> str:
    text = f"{AT}unexpected shape for input '{name}' for model '{model}'. Expected {expected}, "
    return text + f"got {got}." + (BATCH_DIM_NOTE if note else "")


@pytest.mark.parametrize("shape", [(3,), (3, 4, 1), (3, 2, 2)])
def test_wrong_rank(shape: tuple[int, ...]) -> None:
    inputs = good()
    inputs[0] = fp32(shape)
    got = "[" + ",".join(map(str, shape)) + "]"
    assert invalid(inputs) == _shape_error("A", "[-1,4]", got)


def test_fixed_dim_mismatch() -> None:
    inputs = good()
    inputs[0] = fp32((3, 5))
    assert invalid(inputs) == _shape_error("A", "[-1,4]", "[3,5]")
    inputs = good()
    inputs[1] = int64((3, 5, 3))
    assert invalid(inputs) == _shape_error("B", "[-1,-1,2]", "[3,5,3]")


@pytest.mark.parametrize("variable", [0, 1, 7, 1000])
def test_variable_dims_accept_any_size(variable: int) -> None:
    inputs = good(2)
    inputs[1] = int64((2, variable, 2))
    assert validate_inputs(SIG, inputs) == 2


def test_missing_batch_dim() -> None:
    inputs = good()
    inputs[0] = fp32((0, 4))
    assert invalid(inputs) == "input 'A': shape [0, 4] lacks a batch dim"
    sig = Signature.from_config({**CONFIG, "input": [CONFIG["input"][0]]})
    assert invalid([Tensor("A", "FP32", (), b"")], sig) == "input 'A': shape [] lacks a batch dim"


def test_inputs_with_differing_batch_dims() -> None:
    inputs = [fp32((3, 4)), int64((2, 5, 2)), strings(3)]
    message = invalid(inputs)
    assert message == f"{AT}input 'B' batch size does not match other inputs for 'm'"


def test_batch_larger_than_max_batch_size() -> None:
    message = invalid(good(9))
    assert message == f"{AT}inference request batch-size must be <= 8 for 'm'"


def test_negative_dim() -> None:
    inputs = good()
    inputs[1] = Tensor("B", "INT64", (3, -2, 2), b"")
    assert invalid(inputs) == "input 'B': negative dim in shape [3, -2, 2]"


def test_byte_size_mismatch() -> None:
    inputs = good()
    inputs[0] = Tensor("A", "FP32", (3, 4), b"\0" * 44)
    assert invalid(inputs) == f"{AT}{MISMATCH.format('A', 'm', 48, 44)}"


def test_byte_size_of_a_memoryview_counts_bytes() -> None:
    array = np.zeros((2, 4), dtype="<f4")
    inputs = [Tensor("A", "FP32", (2, 4), memoryview(array)), int64((2, 1, 2)), strings(2)]
    assert validate_inputs(SIG, inputs) == 2
    inputs[0] = Tensor("A", "FP32", (2, 4), memoryview(array)[:1])
    assert invalid(inputs) == f"{AT}{MISMATCH.format('A', 'm', 32, 16)}"


NO_BATCH = Signature.from_config(
    {
        "name": "flat",
        "max_batch_size": 0,
        "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [2, 3]}],
        "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [2, 3]}],
    }
)


def int32(shape: tuple[int, ...]) -> Tensor:
    return Tensor("X", "INT32", shape, np.zeros(shape, dtype="<i4").tobytes())


def test_max_batch_size_zero_has_no_batch_dim() -> None:
    assert NO_BATCH.full_shape(NO_BATCH.inputs[0]) == [2, 3]
    assert validate_inputs(NO_BATCH, [int32((2, 3))]) == 1
    message = invalid([int32((1, 2, 3))], NO_BATCH)
    assert message == _shape_error("X", "[2,3]", "[1,2,3]", "flat", note=False)
    message = invalid([int32((4, 3))], NO_BATCH)
    assert message == _shape_error("X", "[2,3]", "[4,3]", "flat", note=False)


OPTIONAL = Signature.from_config(
    {
        "name": "opt",
        "max_batch_size": 4,
        "input": [
            {"name": "A", "data_type": "TYPE_FP32", "dims": [4]},
            {"name": "MASK", "data_type": "TYPE_BOOL", "dims": [4], "optional": True},
        ],
        "output": [],
    }
)


def test_optional_input_may_be_absent() -> None:
    assert OPTIONAL.inputs[1].optional
    assert validate_inputs(OPTIONAL, [fp32((2, 4))]) == 2


def test_optional_input_is_still_checked_when_present() -> None:
    mask = Tensor("MASK", "BOOL", (2, 4), b"\x01" * 8)
    assert validate_inputs(OPTIONAL, [fp32((2, 4)), mask]) == 2
    short_mask = Tensor("MASK", "BOOL", (2, 4), b"\x01" * 7)
    assert invalid([fp32((2, 4)), short_mask], OPTIONAL) == (
        f"{AT}{MISMATCH.format('MASK', 'opt', 8, 7)}"
    )
    assert invalid([fp32((2, 4)), Tensor("MASK", "BOOL", (3, 4), b"\x01" * 12)], OPTIONAL) == (
        f"{AT}input 'MASK' batch size does not match other inputs for 'opt'"
    )


def test_required_input_missing_next_to_an_optional_one() -> None:
    mask = Tensor("MASK", "BOOL", (2, 4), b"\x01" * 8)
    assert invalid([mask], OPTIONAL) == "expected input 'A' for model 'opt'"


def test_batch_limit_uses_the_model_name_and_its_max() -> None:
    assert invalid([fp32((5, 4))], OPTIONAL) == (
        f"{AT}inference request batch-size must be <= 4 for 'opt'"
    )
