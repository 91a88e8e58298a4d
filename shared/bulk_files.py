"""Bulk job files: `.npy`/`.npz` arrays or JSON Lines of infer bodies in, the same kind out.

An array file holds one item per row of its first axis (an `.npz` one array per input name);
a JSON Lines file holds one KServe v2 infer body per line. Results come back in input order:
an `.npz` of each output stacked row by row plus `__status__` (HTTP status per item) and
`__error__` (message, empty when it worked); or one infer response (or error) per line.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from sluice.shared.bulk_arrays import MAX_BYTES, load_npy, load_npz
from sluice.shared.datatypes import (
    NUMPY_DTYPE,
    deserialize_bytes_elements,
    serialize_bytes_elements,
    wire_from_numpy,
)
from sluice.shared.errors import InvalidInput, error_from_code
from sluice.shared.infer_codec import ParsedInfer, encode_response, parse_infer
from sluice.shared.protocol import Result, Tensor
from sluice.shared.signature import Signature, validate_inputs

FORMATS = ("npz", "npy", "jsonl")
STATUS_ARRAY = "__status__"
ERROR_ARRAY = "__error__"


@dataclass(slots=True)
class Item:
    """One request of a bulk job."""

    inputs: list[Tensor]
    parameters: dict[str, Any] = field(default_factory=dict)
    outputs: tuple[str, ...] | None = None
    #: the line's own `id` (JSON Lines), echoed in its response line.
    client_id: str | None = None


def format_of(filename: str) -> str:
    """The file format its name says (`x.npz` -> npz); InvalidInput naming the file otherwise."""
    suffix = filename.rsplit(".", 1)[-1].lower() if "." in filename else ""
    if suffix == "ndjson":
        return "jsonl"
    if suffix not in FORMATS:
        raise InvalidInput(f"'{filename}': bulk input must be .npz, .npy or .jsonl")
    return suffix


def check_output_shapes(sig: Signature, fmt: str) -> None:
    """Array outputs stack row by row, so they need fixed dims; JSON Lines takes any."""
    if fmt == "jsonl":
        return
    for spec in sig.outputs:
        if -1 in spec.dims:
            raise InvalidInput(
                f"output '{spec.name}' of '{sig.name}' has variable dims {list(spec.dims)}: "
                "use a .jsonl input for this model"
            )


def read_items(data: bytes, fmt: str, sig: Signature, *, max_bytes: int = MAX_BYTES) -> list[Item]:
    """Every item of the file, validated against the model; errors name the field or line.
    An `.npz`'s arrays may inflate to `max_bytes` in all (--max-body-bytes), no further."""
    if fmt == "jsonl":
        return _jsonl_items(data, sig)
    return _array_items(_arrays(data, fmt, sig, max_bytes), sig)


def _arrays(data: bytes, fmt: str, sig: Signature, max_bytes: int) -> dict[str, np.ndarray]:
    if fmt == "npz":
        return load_npz(data, max_bytes)
    required = [s for s in sig.inputs if not s.optional]
    if len(required) != 1:
        raise InvalidInput(
            f"an .npy file feeds a model with one input; '{sig.name}' needs "
            f"{[s.name for s in required]}: use an .npz with one array per input"
        )
    return {required[0].name: load_npy(data, "bulk input")}


def _array_items(arrays: dict[str, np.ndarray], sig: Signature) -> list[Item]:
    if not arrays:
        raise InvalidInput("bulk input holds no arrays")
    counts = {name: (a.shape[0] if a.ndim else 0) for name, a in arrays.items()}
    total = next(iter(counts.values()))
    if len(set(counts.values())) != 1:
        raise InvalidInput(f"bulk input arrays differ in their number of rows: {counts}")
    if total == 0:
        raise InvalidInput("bulk input holds no items")
    columns = {name: _rows(name, a) for name, a in arrays.items()}
    batched = sig.max_batch_size > 0
    items = []
    for i in range(total):
        tensors = [
            Tensor(name, datatype, (1, *shape) if batched else shape, rows[i])
            for name, (datatype, shape, rows) in columns.items()
        ]
        items.append(Item(tensors))
    try:
        validate_inputs(sig, items[0].inputs)  # every row has the first row's shape and type
    except InvalidInput as exc:
        raise InvalidInput(f"bulk input: {exc.message}") from None
    return items


def _rows(name: str, array: np.ndarray) -> tuple[str, tuple[int, ...], list[Any]]:
    """(datatype, row shape, per-row bytes): views into one buffer except for strings."""
    if array.dtype.kind in "USO":
        flat = array.reshape(array.shape[0], -1)
        rows = [
            serialize_bytes_elements([v if isinstance(v, bytes) else str(v) for v in row])
            for row in flat
        ]
        return "BYTES", tuple(array.shape[1:]), rows
    try:
        datatype = wire_from_numpy(array.dtype)
    except (KeyError, ValueError):
        raise InvalidInput(f"array '{name}': unsupported dtype {array.dtype}") from None
    contiguous = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    step = contiguous[0].nbytes
    raw = contiguous.reshape(-1).data.cast("B")
    return (
        datatype,
        tuple(array.shape[1:]),
        [raw[i * step : (i + 1) * step] for i in range(len(array))],
    )


def _jsonl_items(data: bytes, sig: Signature) -> list[Item]:
    items = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            parsed = parse_infer(line, None, sig)
            validate_inputs(sig, parsed.inputs)
        except InvalidInput as exc:
            raise InvalidInput(f"line {number}: {exc.message}") from None
        outputs = tuple(parsed.outputs) if parsed.outputs else None
        items.append(Item(parsed.inputs, parsed.parameters, outputs, parsed.id))
    if not items:
        raise InvalidInput("bulk input holds no items")
    return items


def write_output(
    fmt: str, sig: Signature, version: int, items: Sequence[Item], results: Sequence[Result]
) -> bytes:
    """The results file, in input order."""
    if fmt == "jsonl":
        return b"".join(
            _jsonl_line(sig.name, version, item, result) + b"\n"
            for item, result in zip(items, results, strict=True)
        )
    return _npz(sig, results)


def _jsonl_line(model: str, version: int, item: Item, result: Result) -> bytes:
    if result.error is not None:
        error = error_from_code(*result.error)
        line = {"id": item.client_id, "error": error.message, "status": error.http_status}
        return orjson.dumps({k: v for k, v in line.items() if v is not None})
    request = ParsedInfer(item.client_id, {}, [], None)
    body, _ = encode_response(model, version, request, result.outputs)
    assert isinstance(body, bytes)  # JSON only: no binary outputs asked for
    return body


def _npz(sig: Signature, results: Sequence[Result]) -> bytes:
    status = np.full(len(results), 200, dtype=np.int32)
    errors = np.full(len(results), "", dtype=object)
    for i, result in enumerate(results):
        if result.error is not None:
            error = error_from_code(*result.error)
            status[i], errors[i] = error.http_status, error.message
    arrays: dict[str, np.ndarray] = {}
    first = next((r for r in results if r.error is None), None)
    for template in first.outputs if first is not None else ():
        rows = [_row(r, template) for r in results]
        if sig.max_batch_size > 0:
            arrays[template.name] = np.concatenate(rows)
        else:
            arrays[template.name] = np.stack(rows)
    arrays[STATUS_ARRAY] = status
    arrays[ERROR_ARRAY] = errors.astype(str)
    out = io.BytesIO()
    np.savez(out, allow_pickle=False, **arrays)
    return out.getvalue()


def _row(result: Result, template: Tensor) -> np.ndarray:
    """The result's tensor named like `template`; zeros in its shape when the item failed."""
    tensor = next((t for t in result.outputs if t.name == template.name), None)
    if tensor is None:
        dtype = np.bytes_ if template.datatype == "BYTES" else NUMPY_DTYPE[template.datatype]
        return np.zeros(template.shape, dtype=dtype)
    if tensor.datatype == "BYTES":
        return np.array(deserialize_bytes_elements(tensor.data), dtype=np.bytes_).reshape(
            tensor.shape
        )
    return np.frombuffer(tensor.data, NUMPY_DTYPE[tensor.datatype]).reshape(tensor.shape)
