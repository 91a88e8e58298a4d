"""KServe v2 gRPC infer messages in and out: ModelInferRequest to the core's ParsedInfer, an
InferOutcome to ModelInferResponse.

Raw inputs (`raw_input_contents`, what tritonclient and perf_analyzer send) become tensors
over the bytes protobuf handed us, with no further copy; typed `contents` are converted once
with numpy. Outputs always go back raw, the only form tritonclient reads. Errors name the
input and the model, with Triton's wording where Triton has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from sluice.gateway.infer_results import InferOutcome
from sluice.shared.datatypes import (
    ELEMENT_SIZE,
    NUMPY_DTYPE,
    element_count,
    serialize_bytes_elements,
)
from sluice.shared.errors import InvalidInput
from sluice.shared.infer_codec import (
    ParsedInfer,
    SharedMemoryRead,
    SharedMemorySpan,
    shared_memory_span,
)
from sluice.shared.log_settings import LogSettings
from sluice.shared.protocol import Buffer, ResponseParameter, Tensor
from sluice.shared.sequence_controls import GRPC_KINDS, check_grpc_kind
from sluice.shared.signature import Signature
from sluice.shared.trace_settings import TraceSettings
from tritonclient.grpc import service_pb2 as pb

#: the typed `contents` field that carries each datatype (FP16 and BF16 have none: raw only).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

#: parameters that ask for what a gateway apart from its clients cannot do.
UNSUPPORTED_PARAMETERS = {
    "classification": "classification outputs are not supported: request the raw output",
}


def parameter_values(parameters: Any) -> dict[str, Any]:
    """A protobuf map of InferParameter (or ModelRepositoryParameter) as plain values."""
    values: dict[str, Any] = {}
    if not parameters:  # the usual case, and iterating an empty map is not free
        return values
    for key, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        if kind is not None:
            values[key] = getattr(parameter, kind)
    return values


@dataclass(slots=True)
class GrpcInfer:
    """A ModelInferRequest as the core's InferInput: grpc has already inflated it and held it
    to the message size limit, so there is nothing left to inflate."""

    request: Any  # service_pb2.ModelInferRequest
    #: reads inputs from the client's shared memory (None: not on this call).
    shared_memory: SharedMemoryRead | None = None

    def inflate(self, max_body_bytes: int) -> bytes:
        return b""

    def decode(self, body: bytes, sig: Signature) -> ParsedInfer:
        request = self.request
        raw = request.raw_input_contents
        if len(raw) > len(request.inputs):
            raise InvalidInput(
                f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs of model "
                f"'{sig.name}'"
            )
        inputs = [
            _input(item, index, raw, sig.name, self.shared_memory)
            for index, item in enumerate(request.inputs)
        ]
        outputs: dict[str, bool | None] | None = None
        in_shm: dict[str, SharedMemorySpan] = {}
        if request.outputs:
            outputs = {}
            for output in request.outputs:
                where = f"output '{output.name}'"
                _refuse_unsupported(output.parameters, where)
                span = shared_memory_span(parameter_values(output.parameters), where)
                if span is not None:
                    in_shm[output.name] = span
                outputs[output.name] = None
        parameters = request.parameters
        if parameters:
            for name in GRPC_KINDS.keys() & parameters.keys():
                check_grpc_kind(name, parameters[name].WhichOneof("parameter_choice"))
        return ParsedInfer(
            request.id or None,
            parameter_values(parameters),
            inputs,
            outputs,
            True,
            shm_outputs=in_shm,
        )


def _refuse_unsupported(parameters: Any, where: str) -> None:
    if not parameters:
        return
    for key, reason in UNSUPPORTED_PARAMETERS.items():
        if key in parameters:
            raise InvalidInput(f"{where}: {reason}")


def _input(
    item: Any, index: int, raw: Any, model: str, shared_memory: SharedMemoryRead | None
) -> Tensor:
    name, datatype = item.name, item.datatype
    where = f"input '{name}'"
    if datatype not in ELEMENT_SIZE:
        raise InvalidInput(f"{where}: unknown datatype '{datatype}'")
    _refuse_unsupported(item.parameters, where)
    shape = tuple(item.shape)
    span = shared_memory_span(parameter_values(item.parameters), where)
    if span is not None:
        if shared_memory is None:
            raise InvalidInput(f"{where}: shared memory is not served on this call")
        data = shared_memory(span.region, span.offset, span.byte_size)
        if datatype == "BYTES":
            _check_bytes_elements(where, data, shape)
        return Tensor(name, datatype, shape, data)
    if raw:
        if item.HasField("contents"):
            raise InvalidInput(
                f"contents field must not be specified when using raw_input_contents for "
                f"'{name}' for model '{model}'"
            )
        if index >= len(raw):
            raise InvalidInput(
                f"unable to find data for input tensor '{name}' for model '{model}' in request."
            )
        data = raw[index]
        if datatype == "BYTES":
            _check_bytes_elements(where, data, shape)
        return Tensor(name, datatype, shape, data)
    if not item.HasField("contents"):
        raise InvalidInput(
            f"unable to find data for input tensor '{name}' for model '{model}' in request."
        )
    return Tensor(name, datatype, shape, _typed_contents(item.contents, datatype, shape, where))


def _check_bytes_elements(where: str, data: Buffer, shape: tuple[int, ...]) -> None:
    """Raw BYTES hold `<u32 length><bytes>` per element: as many as the shape says."""
    view, pos, found = memoryview(data), 0, 0
    while pos < len(view):
        if pos + 4 > len(view):
            raise InvalidInput(f"{where}: malformed BYTES data: truncated element length")
        pos += 4 + int.from_bytes(view[pos : pos + 4], "little")
        if pos > len(view):
            raise InvalidInput(f"{where}: malformed BYTES data: element runs past its buffer")
        found += 1
    if found != element_count(shape):
        raise InvalidInput(f"{where}: {found} BYTES elements for shape {list(shape)}")


def _typed_contents(contents: Any, datatype: str, shape: tuple[int, ...], where: str) -> bytes:
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidInput(
            f"{where}: {datatype} has no typed 'contents' field: send it in raw_input_contents"
        )
    values = getattr(contents, field)
    if len(values) != element_count(shape):
        raise InvalidInput(
            f"{where}: {len(values)} values in contents.{field} for shape {list(shape)}"
        )
    if datatype == "BYTES":
        return serialize_bytes_elements(values)
    dtype = NUMPY_DTYPE[datatype]
    if dtype.kind in "iu" and dtype.itemsize < 4 and len(values):
        info = np.iinfo(dtype)
        low, high = min(values), max(values)
        if low < info.min or high > info.max:
            raise InvalidInput(f"{where}: contents.{field} holds values outside {datatype}")
    return np.asarray(values, dtype=dtype).tobytes()


def infer_response(outcome: InferOutcome) -> Any:
    """The ModelInferResponse of a served request: every output raw, the request id echoed.
    Built in place: nested messages passed to a constructor are copied into it."""
    response = pb.ModelInferResponse(
        model_name=outcome.model, model_version=str(outcome.version), id=outcome.request.id or ""
    )
    add_output, raw = response.outputs.add, response.raw_output_contents
    in_shm = outcome.request.shm_outputs
    for t in outcome.outputs:
        add_output(name=t.name, datatype=t.datatype, shape=t.shape)
        # an output written into shared memory keeps its place with empty contents, as Triton's
        raw.append(b"" if t.name in in_shm else bytes(t.data))
    for key, value in (outcome.parameters or {}).items():
        set_parameter(response.parameters[key], value)
    return response


def set_parameter(parameter: Any, value: ResponseParameter) -> None:
    """An InferParameter holding `value` in the field Triton uses for its type."""
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        parameter.int64_param = value
    else:
        parameter.string_param = value


def log_changes(request: Any) -> dict[str, Any]:
    """A LogSettings request's settings as the JSON values `/v2/logging` takes; a flag given as
    a number means its truth, a level given as a flag 0 or 1 (as tritonserver takes them)."""
    changes: dict[str, Any] = {}
    for name, value in request.settings.items():
        kind = value.WhichOneof("parameter_choice")
        if kind is None:
            continue
        given = getattr(value, kind)
        if name in ("log_info", "log_warning", "log_error") and kind == "uint32_param":
            given = bool(given)
        elif name == "log_verbose_level" and kind == "bool_param":
            given = int(given)
        changes[name] = given
    return changes


def log_settings_response(settings: LogSettings) -> Any:
    value = pb.LogSettingsResponse.SettingValue
    return pb.LogSettingsResponse(
        settings={
            "log_file": value(string_param=settings.log_file),
            "log_info": value(bool_param=settings.log_info),
            "log_warning": value(bool_param=settings.log_warning),
            "log_error": value(bool_param=settings.log_error),
            "log_verbose_level": value(uint32_param=settings.log_verbose_level),
            "log_format": value(string_param=settings.log_format),
        }
    )


def trace_changes(request: Any) -> dict[str, Any]:
    """A TraceSetting request's settings as the JSON `/v2/trace/setting` takes: the level a
    list, the others their one string; an empty value drops the value set before (null)."""
    changes: dict[str, Any] = {}
    for name, setting in request.settings.items():
        values = list(setting.value)
        if not values:
            changes[name] = None
        else:
            changes[name] = values if name == "trace_level" else values[0]
    return changes


def trace_settings_response(settings: TraceSettings) -> Any:
    value = pb.TraceSettingResponse.SettingValue
    answer = settings.to_json()
    return pb.TraceSettingResponse(
        settings={
            name: value(value=shown if isinstance(shown, list) else [shown])
            for name, shown in answer.items()
        }
    )
