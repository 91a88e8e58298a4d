"""Request bodies and responses of the KServe v2 binary tensor extension, for the SDK."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import orjson

from sluice.shared.datatypes import (
    NUMPY_DTYPE,
    deserialize_bytes_elements,
    serialize_bytes_elements,
    wire_from_numpy,
)

from .errors import error_for_status

Tensorish = Any  # numpy arrays, torch tensors, nested lists
#: what outputs come back as: numpy arrays, or torch tensors (BYTES outputs stay numpy).
TensorKind = Literal["numpy", "torch"]

HEADER_LENGTH = "Inference-Header-Content-Length"


def to_numpy(value: Tensorish) -> np.ndarray:
    """numpy arrays as they are, torch tensors without a copy when on the CPU."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def raw_tensor(value: Tensorish) -> tuple[str, tuple[int, ...], bytes]:
    """(datatype, shape, little-endian row-major bytes) of a numpy/torch/list value."""
    array = to_numpy(value)
    datatype = wire_from_numpy(array.dtype)
    if datatype == "BYTES":
        data = serialize_bytes_elements(
            [v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1)]
        )
    else:
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return datatype, tuple(array.shape), data


def array_of(datatype: str, shape: Any, raw: bytes | bytearray | memoryview) -> np.ndarray:
    if datatype == "BYTES":
        items = deserialize_bytes_elements(raw)
        array = np.empty(len(items), dtype=object)
        array[:] = items
        return array.reshape(shape)
    return np.frombuffer(raw, NUMPY_DTYPE[datatype]).reshape(shape)


def as_kind(outputs: dict[str, np.ndarray], kind: TensorKind) -> dict[str, Any]:
    if kind == "numpy":
        return outputs
    import torch

    # a copy: the arrays are read-only views of the response, which torch cannot share
    return {n: v if v.dtype == object else torch.from_numpy(v.copy()) for n, v in outputs.items()}


def encode_request(
    inputs: Mapping[str, Tensorish],
    outputs: list[str] | None,
    request_id: str | None,
    parameters: Mapping[str, Any] | None,
) -> tuple[bytes, dict[str, str]]:
    """A binary-extension body (JSON header, then raw tensors) and its headers."""
    items, blobs = [], []
    for name, value in inputs.items():
        datatype, shape, data = raw_tensor(value)
        items.append(
            {
                "name": name,
                "shape": list(shape),
                "datatype": datatype,
                "parameters": {"binary_data_size": len(data)},
            }
        )
        blobs.append(data)
    header: dict[str, Any] = {"inputs": items, "parameters": {"binary_data_output": True}}
    if parameters:
        header["parameters"].update(parameters)
    if outputs is not None:
        header["outputs"] = [{"name": n, "parameters": {"binary_data": True}} for n in outputs]
    if request_id is not None:
        header["id"] = request_id
    head = orjson.dumps(header)
    return head + b"".join(blobs), {
        HEADER_LENGTH: str(len(head)),
        "Content-Type": "application/octet-stream",
    }


def decode_response(status: int, headers: Mapping[str, str], body: bytes) -> dict[str, np.ndarray]:
    """Named output arrays, or the typed error the server answered with."""
    if status >= 400:
        raise error_for_status(status, _message(body))
    length = headers.get(HEADER_LENGTH.lower())
    end = int(length) if length is not None else len(body)
    return _outputs(orjson.loads(body[:end]), body, end)


def decode_job_responses(
    status: int, headers: Mapping[str, str], body: bytes
) -> list[dict[str, np.ndarray]]:
    """A finished job's responses: a decoupled model's, in order (`"responses"`, each with
    its outputs as JSON), or an ordinary job's one; the first error raises (a response's own
    error as the model's failure, 500)."""
    if status == 200 and HEADER_LENGTH.lower() not in headers:  # all JSON
        answer = orjson.loads(body)
        if isinstance(answer, dict) and "responses" in answer:
            decoded = []
            for response in answer["responses"]:
                if "error" in response:
                    raise error_for_status(500, str(response["error"]))
                decoded.append(_outputs(response, b"", 0))
            return decoded
    return [decode_response(status, headers, body)]


def _outputs(header: Mapping[str, Any], body: bytes, offset: int) -> dict[str, np.ndarray]:
    """The arrays of an infer response's JSON `header`, binary ones read from `body` on."""
    outputs = {}
    for item in header["outputs"]:
        shape, datatype = item["shape"], item["datatype"]
        size = (item.get("parameters") or {}).get("binary_data_size")
        if size is None:
            outputs[item["name"]] = _from_json(item["data"], datatype, shape)
            continue
        outputs[item["name"]] = array_of(datatype, shape, body[offset : offset + size])
        offset += size
    return outputs


def _from_json(data: Any, datatype: str, shape: list[int]) -> np.ndarray:
    if datatype == "BYTES":
        return np.array([s.encode() for s in data], dtype=object).reshape(shape)
    return np.asarray(data, dtype=NUMPY_DTYPE[datatype]).reshape(shape)


def _message(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body.decode("utf-8", "replace")
