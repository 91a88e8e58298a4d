"""KServe v2 infer bodies, JSON and Triton's binary tensor extension, in and out.

Binary inputs become memoryviews into the HTTP body (no copy until the Redis write); JSON
inputs are converted once with numpy. Every error names the field it is about.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
from sluice.shared.datatypes import (
    ELEMENT_SIZE,
    NUMPY_DTYPE,
    deserialize_bytes_elements,
    element_count,
    serialize_bytes_elements,
)
from sluice.shared.errors import InvalidInput, PayloadTooLarge
from sluice.shared.protocol import Buffer, ResponseParameter, Tensor
from sluice.shared.sequence_controls import check_json_parameters
from sluice.shared.signature import Signature

HEADER_LENGTH = "inference-header-content-length"
#: Triton 2.51's texts for a body without `inputs`, and for `data` that does not fill its shape
MISSING_INPUTS = "Unable to parse 'inputs': attempt to access non-existing object member 'inputs'"
DATA_SHAPE_MISMATCH = "Unable to parse 'data': Shape does not match true shape of 'data' field"
_ONE_OF = (
    "Input must set only one of the following fields: 'data', 'binary_data_size' in "
    "'parameters', 'shared_memory_region' in 'parameters'."
)
NO_DATA = _ONE_OF + " But no field is set"


#: reads an input from a client's shared memory: (region, offset, byte size) -> its bytes.
SharedMemoryRead = Callable[[str, int, int], Buffer]


@dataclass(frozen=True, slots=True)
class SharedMemorySpan:
    """Where in a client's shared memory a tensor is (Triton's shared-memory parameters)."""

    region: str
    offset: int
    byte_size: int


@dataclass(slots=True)
class ParsedInfer:
    """An infer request as the gateway needs it."""

    id: str | None
    parameters: dict[str, Any]
    inputs: list[Tensor]
    #: requested outputs: name -> wants binary (None: follow binary_data_output).
    outputs: dict[str, bool | None] | None
    binary_output: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    #: outputs to write into the client's shared memory instead of the response.
    shm_outputs: dict[str, SharedMemorySpan] = field(default_factory=dict)


#: zlib's window bits for each Content-Encoding it inflates (deflate: the zlib format).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decompress(body: bytes, encoding: str | None, max_bytes: int) -> bytes:
    """Inflate a gzip or deflate body, never past `max_bytes`: a few KiB can inflate to GiBs."""
    if not encoding or encoding == "identity":
        return body
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise InvalidInput(f"unsupported Content-Encoding '{encoding}'")
    inflater = zlib.decompressobj(wbits)
    try:
        inflated = inflater.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise InvalidInput(f"body is not valid {encoding}: {exc}") from None
    if len(inflated) > max_bytes:
        raise PayloadTooLarge(
            f"request body inflates past the limit of {max_bytes} bytes (--max-body-bytes)"
        )
    if not inflater.eof:
        raise InvalidInput(f"body is not valid {encoding}: it ends early")
    return inflated


def parse_infer(
    body: bytes,
    header_length: int | None,
    sig: Signature,
    shared_memory: SharedMemoryRead | None = None,
) -> ParsedInfer:
    """Parse a JSON or binary-extension infer body; raises InvalidInput naming the field.
    Inputs in the client's shared memory are read through `shared_memory`."""
    if header_length == 0:
        return _raw_binary(body, sig)
    json_end = len(body) if header_length is None else header_length
    if json_end > len(body):
        raise InvalidInput(
            f"inference header size should be in range (0, {len(body)}), got: {json_end}"
        )
    try:
        header = orjson.loads(memoryview(body)[:json_end])
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"failed to parse the request JSON buffer: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidInput("request body must be a JSON object")
    params = header.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be an object")
    if params:
        check_json_parameters(params)
    if "inputs" not in header:
        raise InvalidInput(MISSING_INPUTS)
    raw_inputs = header["inputs"]
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidInput("'inputs' must be a non-empty list")
    binary = memoryview(body)[json_end:]
    inputs, used = [], 0
    for index, item in enumerate(raw_inputs):
        tensor, used = _input(item, index, binary, used, shared_memory)
        inputs.append(tensor)
    if used != len(binary):
        raise InvalidInput(
            f"binary data in the body is {len(binary)} bytes but inputs declare {used}"
        )
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string")
    outputs, shm_outputs = _outputs(header.get("outputs"))
    return ParsedInfer(
        request_id,
        params,
        inputs,
        outputs,
        bool(params.get("binary_data_output", False)),
        shm_outputs=shm_outputs,
    )


def _raw_binary(body: bytes, sig: Signature) -> ParsedInfer:
    if len(sig.inputs) != 1:
        raise InvalidInput(
            "a raw binary request (Inference-Header-Content-Length: 0) needs a model with "
            f"exactly one input; '{sig.name}' has {len(sig.inputs)}"
        )
    spec = sig.inputs[0]
    if -1 in spec.dims:
        raise InvalidInput(f"raw binary request: input '{spec.name}' has variable dims")
    shape = (1, *spec.dims) if sig.max_batch_size > 0 else spec.dims
    return ParsedInfer(None, {}, [Tensor(spec.name, spec.datatype, shape, body)], None, True)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shape(item: Mapping[str, Any], where: str) -> tuple[int, ...]:
    shape = item.get("shape")
    if not isinstance(shape, list):
        raise InvalidInput("Unable to parse 'shape': attempt to access JSON non-array as array")
    if not all(_is_count(d) for d in shape):
        raise InvalidInput(f"{where}: 'shape' must be a list of non-negative integers")
    return tuple(shape)


def _input(
    item: Any, index: int, binary: memoryview, used: int, shared_memory: SharedMemoryRead | None
) -> tuple[Tensor, int]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise InvalidInput(f"inputs[{index}]: must be an object with a string 'name'")
    name = item["name"]
    where = f"input '{name}'"
    datatype = item.get("datatype")
    if not isinstance(datatype, str) or datatype not in ELEMENT_SIZE:
        raise InvalidInput(f"invalid datatype for input {name}")
    shape = _shape(item, where)
    params = item.get("parameters") or {}
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    span = shared_memory_span(params, where) if isinstance(params, dict) else None
    if span is not None:
        if size is not None or "data" in item:
            raise InvalidInput(_ONE_OF + " But more than one of them is set")
        if shared_memory is None:
            raise InvalidInput(f"{where}: shared memory is not served on this endpoint")
        data = shared_memory(span.region, span.offset, span.byte_size)
        if datatype == "BYTES":
            _check_bytes_elements(where, shape, memoryview(data))
        return Tensor(name, datatype, shape, data), used
    if size is not None:
        if not _is_count(size):
            raise InvalidInput(f"{where}: 'binary_data_size' must be a non-negative integer")
        if used + size > len(binary):
            raise InvalidInput(f"{where}: binary_data_size {size} runs past the end of the body")
        data = binary[used : used + size]
        if datatype == "BYTES":  # fixed-size types: validate_inputs checks the byte size
            _check_bytes_elements(where, shape, data)
        return Tensor(name, datatype, shape, data), used + size
    if "data" not in item:
        raise InvalidInput(NO_DATA)
    return Tensor(name, datatype, shape, json_data(item["data"], datatype, shape, where)), used


def _check_bytes_elements(where: str, shape: tuple[int, ...], data: memoryview) -> None:
    try:
        found = len(deserialize_bytes_elements(data))
    except ValueError as exc:
        raise InvalidInput(f"{where}: malformed BYTES data: {exc}") from None
    if found != element_count(shape):
        raise InvalidInput(f"{where}: {found} BYTES elements for shape {list(shape)}")


def _flatten(data: Any) -> list[Any]:
    """Nested lists to a flat list, without recursion (depth is the client's choice)."""
    if not isinstance(data, list):
        return [data]
    flat: list[Any] = data
    while flat and isinstance(flat[0], list):
        level: list[Any] = []
        for item in flat:
            if isinstance(item, list):
                level.extend(item)
            else:
                level.append(item)
        flat = level
    return flat


#: the JSON value types each datatype accepts (bools only for BOOL; checked separately).
_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    dt: ((int, float) if dt.startswith("FP") else int) for dt in ELEMENT_SIZE
}


def json_data(data: Any, datatype: str, shape: tuple[int, ...], where: str) -> bytes:
    """A tensor's JSON values (nested lists, or one value) as its wire bytes; InvalidInput
    when they do not fit `shape` or `datatype`."""
    flat = _flatten(data)
    if len(flat) != element_count(shape):
        raise InvalidInput(DATA_SHAPE_MISMATCH)
    if datatype == "BYTES":
        if not all(isinstance(v, str | bytes) for v in flat):
            raise InvalidInput(f"{where}: BYTES 'data' must hold strings")
        return serialize_bytes_elements(flat)
    if datatype == "BF16":
        raise InvalidInput(f"{where}: BF16 data must be sent in binary (binary_data_size)")
    if datatype == "BOOL" and not all(isinstance(v, bool) for v in flat):
        raise InvalidInput(f"{where}: BOOL 'data' must hold true/false")
    if datatype != "BOOL" and not all(
        isinstance(v, _JSON_TYPES[datatype]) and not isinstance(v, bool) for v in flat
    ):
        raise InvalidInput(f"{where}: 'data' does not hold {datatype} values")
    try:
        array = np.asarray(flat, dtype=NUMPY_DTYPE[datatype])
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidInput(f"{where}: 'data' does not hold {datatype} values: {exc}") from None
    return array.tobytes()


def shared_memory_span(params: Mapping[str, Any], where: str) -> SharedMemorySpan | None:
    """A tensor's place in the client's shared memory, if its parameters give one."""
    region = params.get("shared_memory_region")
    if region is None:
        return None
    byte_size: Any = params.get("shared_memory_byte_size")
    offset: Any = params.get("shared_memory_offset", 0)
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"{where}: 'shared_memory_region' must be a region's name")
    if not _is_count(byte_size):
        raise InvalidInput(
            f"{where}: 'shared_memory_byte_size' must be given with 'shared_memory_region'"
        )
    if not _is_count(offset):
        raise InvalidInput(f"{where}: 'shared_memory_offset' must be a non-negative integer")
    return SharedMemorySpan(region, offset, byte_size)


def _outputs(
    raw: Any,
) -> tuple[dict[str, bool | None] | None, dict[str, SharedMemorySpan]]:
    """The requested outputs (name -> wants binary), and those to write to shared memory."""
    if raw is None:
        return None, {}
    if not isinstance(raw, list):
        raise InvalidInput("'outputs' must be a list")
    wanted: dict[str, bool | None] = {}
    in_shm: dict[str, SharedMemorySpan] = {}
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidInput(f"outputs[{index}]: must be an object with a string 'name'")
        params = item.get("parameters") or {}
        binary = params.get("binary_data") if isinstance(params, dict) else None
        span = (
            shared_memory_span(params, f"output '{item['name']}'")
            if isinstance(params, dict)
            else None
        )
        if span is not None:
            if binary:
                raise InvalidInput("Output can't set both 'shared_memory_region' and 'binary_data'")
            in_shm[item["name"]] = span
        wanted[item["name"]] = bool(binary) if binary is not None else None
    return wanted, in_shm


def json_values(tensor: Tensor) -> Any:
    """A tensor's values, flat, for JSON (a list of strings, or a numpy array)."""
    if tensor.datatype == "BYTES":
        return [b.decode("utf-8", "replace") for b in deserialize_bytes_elements(tensor.data)]
    array = np.frombuffer(tensor.data, dtype=NUMPY_DTYPE[tensor.datatype])
    if tensor.datatype == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    if tensor.datatype == "FP16":
        return array.astype(np.float32)
    return array


def encode_response(
    model: str,
    version: int,
    request: ParsedInfer,
    outputs: Sequence[Tensor],
    parameters: Mapping[str, ResponseParameter] | None = None,
) -> tuple[bytes | list[Buffer], int | None]:
    """The response body (parts to join) and its JSON header length (None: pure JSON);
    the model's response `parameters` go in its "parameters", as Triton's."""
    binaries: list[Buffer] = []
    items = []
    for tensor in outputs:
        want = request.outputs.get(tensor.name) if request.outputs else None
        as_binary = request.binary_output if want is None else want
        item: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if tensor.name in request.shm_outputs:  # written into the client's shared memory
            items.append(item)
            continue
        if as_binary:
            data = tensor.data
            item["parameters"] = {
                "binary_data_size": len(data) if not isinstance(data, memoryview) else data.nbytes
            }
            binaries.append(data)
        else:
            item["data"] = json_values(tensor)
        items.append(item)
    body: dict[str, Any] = {"model_name": model, "model_version": str(version), "outputs": items}
    if request.id is not None:
        body["id"] = request.id
    if parameters:
        body["parameters"] = parameters
    header = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    if not binaries:
        return header, None
    return [header, *binaries], len(header)
