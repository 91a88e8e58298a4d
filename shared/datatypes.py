"""KServe v2 / Triton datatypes: names, element sizes, numpy and torch equivalents.

Tensors travel as raw little-endian row-major bytes plus datatype and shape, so the only
conversions are here. BYTES elements use Triton's layout: a 4-byte LE length, then the bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import numpy as np

#: wire datatype -> bytes per element (BYTES is variable: 0).
ELEMENT_SIZE: dict[str, int] = {
    "BOOL": 1,
    "UINT8": 1,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "INT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "FP16": 2,
    "BF16": 2,
    "FP32": 4,
    "FP64": 8,
    "BYTES": 0,
}

#: wire datatype -> numpy dtype (little-endian). BF16 has no numpy type: it is carried as
#: uint16 bit patterns and becomes torch.bfloat16 in the worker.
NUMPY_DTYPE: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(np.object_),
}

_WIRE_BY_NUMPY: dict[np.dtype, str] = {
    dt: name for name, dt in NUMPY_DTYPE.items() if name not in ("BF16", "BYTES")
}


def config_to_wire(data_type: str) -> str:
    """`TYPE_FP32` -> `FP32`; `TYPE_STRING` -> `BYTES` (Triton's model_configuration table)."""
    name = data_type.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def wire_to_config(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def wire_from_numpy(dtype: np.dtype) -> str:
    """The wire name of a numpy dtype; object/str/bytes arrays are BYTES."""
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    return _WIRE_BY_NUMPY[dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype]


def element_count(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def serialize_bytes_elements(items: Iterable[bytes | str]) -> bytes:
    """Triton's BYTES layout: every element as `<u32 length><bytes>`."""
    parts: list[bytes] = []
    for item in items:
        raw = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def deserialize_bytes_elements(buf: bytes | bytearray | memoryview) -> list[bytes]:
    """Inverse of :func:`serialize_bytes_elements`; raises ValueError on a truncated buffer."""
    view = memoryview(buf)
    out: list[bytes] = []
    pos, end = 0, len(view)
    while pos < end:
        if pos + 4 > end:
            raise ValueError("truncated BYTES element length")
        (length,) = struct.unpack_from("<I", view, pos)
        pos += 4
        if pos + length > end:
            raise ValueError("BYTES element runs past the end of its buffer")
        out.append(bytes(view[pos : pos + length]))
        pos += length
    return out
