"""Building KServe v2 infer bodies and model signatures for the codec tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from sluice.shared.datatypes import (
    NUMPY_DTYPE,
    wire_to_config,
)
from sluice.shared.protocol import Tensor
from sluice.shared.signature import Signature


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
#: the data of one row of SIG's input.
FOUR = [1, 2, 3, 4]


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
