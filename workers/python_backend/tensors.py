"""`pb_utils.Tensor` and Triton's datatype helpers, and the crossing to sluice's wire tensors.

Inputs reach a model as numpy views over the request's bytes, read-only and never copied (BYTES
inputs are object arrays of `bytes`, as in Triton); outputs go back with the datatype that the
model's config gives them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.utils.dlpack
from sluice.shared.datatypes import (
    NUMPY_DTYPE,
    deserialize_bytes_elements,
    serialize_bytes_elements,
    wire_from_numpy,
)
from sluice.shared.protocol import Tensor as WireTensor
from sluice.workers.python_backend.errors import TritonModelException

#: Triton's TRITONSERVER_DataType numbers (also the config's TYPE_* numbers), by wire name.
TRITON_TYPE: dict[str, int] = {
    "BOOL": 1,
    "UINT8": 2,
    "UINT16": 3,
    "UINT32": 4,
    "UINT64": 5,
    "INT8": 6,
    "INT16": 7,
    "INT32": 8,
    "INT64": 9,
    "FP16": 10,
    "FP32": 11,
    "FP64": 12,
    "BYTES": 13,
    "BF16": 14,
}
_WIRE_BY_TYPE = {number: name for name, number in TRITON_TYPE.items()}

#: Triton's table: TYPE_BOOL is Python's `bool`, and there is no TYPE_BF16 (a KeyError).
TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
_NUMPY_BY_TYPE: dict[int, Any] = {
    TRITON_TYPE[name.removeprefix("TYPE_")] if name != "TYPE_STRING" else 13: np_type
    for name, np_type in TRITON_STRING_TO_NUMPY.items()
}
_NUMPY_BY_TYPE[1] = np.bool_


def wire_name(triton_type: int) -> str:
    """The wire datatype of a TRITONSERVER_DataType number."""
    return _WIRE_BY_TYPE[triton_type]


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    """The numpy type of a TRITONSERVER_DataType number (None for BF16 and unknown ones)."""
    return _NUMPY_BY_TYPE.get(data_type)


#: the numbers of the usual dtypes, looked up first: a Tensor is made per output per request.
_TYPE_BY_DTYPE: dict[np.dtype, int] = {
    dtype: TRITON_TYPE[name] for name, dtype in NUMPY_DTYPE.items() if name not in ("BF16",)
}


def numpy_to_triton_type(data_type: Any) -> int | None:
    """The TRITONSERVER_DataType number of a numpy type (None when Triton has none)."""
    dtype = np.dtype(data_type)
    known = _TYPE_BY_DTYPE.get(dtype)
    if known is not None:
        return known
    if dtype.kind in ("O", "S"):
        return TRITON_TYPE["BYTES"]
    try:
        return TRITON_TYPE[wire_from_numpy(dtype)]
    except KeyError:
        return None


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray | tuple[()]:
    """Triton's BYTES layout (each element as a 4-byte length then its bytes, C order) as a
    0-d object array holding the bytes; `()` for an empty tensor."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype.kind not in ("O", "S"):
        raise TritonModelException("cannot serialize bytes tensor: invalid datatype")
    flat = serialize_bytes_elements(_element_bytes(v) for v in input_tensor.reshape(-1, order="C"))
    return np.asarray(flat, dtype=np.object_)


def deserialize_bytes_tensor(encoded_tensor: bytes | np.ndarray) -> np.ndarray:
    """The elements of a BYTES buffer as a 1-d object array of `bytes`."""
    raw = encoded_tensor.tobytes() if isinstance(encoded_tensor, np.ndarray) else encoded_tensor
    return _object_array(deserialize_bytes_elements(raw))


def _element_bytes(value: Any) -> bytes:
    """Bytes stay as they are; anything else goes as its text in UTF-8, as Triton sends it."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, np.bytes_):
        return bytes(value)
    return str(value).encode("utf-8")


def _object_array(items: list[bytes]) -> np.ndarray:
    array = np.empty(len(items), dtype=np.object_)
    array[:] = items
    return array


class Tensor:
    """A named tensor as Triton's Python backend has it: numpy inside (BF16 as its uint16
    bit patterns), on the CPU."""

    __slots__ = ("_array", "_name", "_type")

    def __init__(self, name: str, tensor: Any, triton_type: int | None = None) -> None:
        array = tensor if isinstance(tensor, np.ndarray) else np.asarray(tensor)
        if triton_type is None:
            if array.dtype.kind == "U":
                array = array.astype(np.object_)
            triton_type = numpy_to_triton_type(array.dtype)
            if triton_type is None:
                raise TypeError(f"tensor '{name}': numpy dtype {array.dtype} has no Triton type")
        self._name = name
        self._array = array
        self._type = triton_type

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        if self._type == TRITON_TYPE["BF16"]:
            raise TritonModelException(
                f"tensor '{self._name}' is BF16, which numpy cannot hold: use to_dlpack()"
            )
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        return self._type

    def is_cpu(self) -> bool:
        return True

    def _torch(self) -> torch.Tensor:
        if self._type == TRITON_TYPE["BYTES"]:
            raise TypeError(f"tensor '{self._name}': BYTES tensors have no DLPack form")
        array = self._array if self._array.flags.writeable else self._array.copy()
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor.view(torch.bfloat16) if self._type == TRITON_TYPE["BF16"] else tensor

    def to_dlpack(self) -> Any:
        return self._torch().__dlpack__()

    def __dlpack__(self, stream: Any = None) -> Any:
        return self._torch().__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        device: tuple[int, int] = self._torch().__dlpack_device__()
        return device

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        """A tensor from a DLPack capsule or object (a GPU tensor is copied to the CPU)."""
        tensor = torch.utils.dlpack.from_dlpack(capsule).detach().cpu()
        if tensor.dtype == torch.bfloat16:
            return Tensor(name, tensor.view(torch.int16).numpy().view(np.uint16), 14)
        return Tensor(name, tensor.numpy())

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, {_WIRE_BY_TYPE.get(self._type)}, {self.shape()})"


def from_wire(tensor: WireTensor) -> Tensor:
    """A request's input as a Tensor over its bytes (no copy; BYTES elements are split out)."""
    if tensor.datatype == "BYTES":
        array = _object_array(deserialize_bytes_elements(tensor.data)).reshape(tensor.shape)
    else:
        dtype = NUMPY_DTYPE[tensor.datatype]
        array = np.frombuffer(tensor.data, dtype=dtype).reshape(tensor.shape)
    return Tensor(tensor.name, array, TRITON_TYPE[tensor.datatype])


def to_wire(tensor: Tensor, datatype: str) -> WireTensor:
    """A returned output as wire bytes of `datatype` (the config's); ValueError when its
    values cannot be that type."""
    name, array = tensor.name(), tensor._array
    if datatype == "BYTES":
        if array.dtype.kind not in ("O", "S", "U"):
            raise ValueError(
                f"output '{name}' is BYTES in the config but the model gave {array.dtype}"
            )
        data: bytes | memoryview = serialize_bytes_elements(
            _element_bytes(v) for v in array.reshape(-1)
        )
        return WireTensor(name, datatype, tuple(array.shape), data)
    if array.dtype.kind in ("O", "S", "U"):
        raise ValueError(f"output '{name}' is {datatype} in the config but the model gave BYTES")
    if datatype == "BF16" and tensor.triton_dtype() != TRITON_TYPE["BF16"]:
        bits = torch.from_numpy(np.ascontiguousarray(array)).to(torch.bfloat16).view(torch.int16)
        array = bits.numpy().view(np.uint16)
    expected = NUMPY_DTYPE[datatype]
    if array.dtype != expected:
        array = array.astype(expected)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    data = array.data.cast("B") if array.size else b""
    return WireTensor(name, datatype, array.shape, data)
