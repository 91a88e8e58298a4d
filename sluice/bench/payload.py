"""Infer requests built from the model's own metadata and config, encoded once per run.

Inputs get the names, datatypes and shapes the server reports (variable dims become 1, the
batch dim becomes --batch-size), so one command benchmarks any model without a data file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import orjson

from sluice.bench.http import encode_request
from sluice.shared.datatypes import NUMPY_DTYPE, serialize_bytes_elements

InputData = Literal["random", "zeros"]


@dataclass(frozen=True, slots=True)
class InputSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]


def input_specs(
    metadata: Mapping[str, Any], config: Mapping[str, Any], batch_size: int
) -> list[InputSpec]:
    """The request tensors for one request of `batch_size` rows."""
    max_batch = int(config.get("max_batch_size", 0))
    batching = max_batch > 0
    if batch_size > max(max_batch, 1):
        raise ValueError(
            f"--batch-size {batch_size} exceeds the max_batch_size ({max_batch}) of model "
            f"'{metadata.get('name')}'"
        )
    specs = []
    for item in metadata.get("inputs") or []:
        dims = [1 if int(d) < 0 else int(d) for d in item["shape"]]
        if batching:
            dims[0] = batch_size
        specs.append(InputSpec(item["name"], item["datatype"], tuple(dims)))
    if not specs:
        raise ValueError(f"model '{metadata.get('name')}' reports no inputs")
    return specs


def make_array(spec: InputSpec, kind: InputData, rng: np.random.Generator) -> np.ndarray:
    """Data for one input; BF16 as uint16 bit patterns, BYTES as an object array of bytes."""
    if spec.datatype == "BYTES":
        if kind == "zeros":
            return np.full(spec.shape, b"", dtype=object)
        letters = rng.integers(ord("a"), ord("z") + 1, (*spec.shape, 8), dtype=np.uint8)
        flat = [row.tobytes() for row in letters.reshape(-1, 8)]
        return np.array(flat, dtype=object).reshape(spec.shape)
    dtype = NUMPY_DTYPE[spec.datatype]
    if kind == "zeros":
        return np.zeros(spec.shape, dtype)
    if spec.datatype == "BF16":
        floats = rng.random(spec.shape, dtype=np.float32)
        return (floats.view(np.uint32) >> 16).astype(np.uint16)
    if spec.datatype == "BOOL":
        return rng.random(spec.shape) < 0.5
    if dtype.kind == "f":
        return rng.random(spec.shape).astype(dtype)
    return rng.integers(0, 100, spec.shape).astype(dtype)


def _raw(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return serialize_bytes_elements(array.reshape(-1).tolist())
    return np.ascontiguousarray(array).tobytes()


def _json_values(array: np.ndarray, datatype: str) -> list[Any]:
    flat = array.reshape(-1)
    if datatype == "BYTES":
        return [item.decode() for item in flat.tolist()]
    if datatype == "BF16":
        return (flat.astype(np.uint32) << 16).view(np.float32).tolist()
    return flat.tolist()


def encode_infer(
    authority: str,
    model: str,
    specs: list[InputSpec],
    arrays: list[np.ndarray],
    *,
    binary: bool,
    auth_token: str | None = None,
) -> bytes:
    """The full HTTP request; binary tensors (and outputs) by default, as perf_analyzer sends."""
    path = f"/v2/models/{model}/infer"
    if not binary:
        inputs = [
            {
                "name": s.name,
                "shape": list(s.shape),
                "datatype": s.datatype,
                "data": _json_values(a, s.datatype),
            }
            for s, a in zip(specs, arrays, strict=True)
        ]
        body = orjson.dumps({"inputs": inputs})
        headers = {"Content-Type": "application/json"}
        return encode_request("POST", authority, path, body, headers, auth_token)
    raws = [_raw(a, s.datatype) for s, a in zip(specs, arrays, strict=True)]
    inputs = [
        {
            "name": s.name,
            "shape": list(s.shape),
            "datatype": s.datatype,
            "parameters": {"binary_data_size": len(raw)},
        }
        for s, raw in zip(specs, raws, strict=True)
    ]
    header = orjson.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}})
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return encode_request("POST", authority, path, header + b"".join(raws), headers, auth_token)
