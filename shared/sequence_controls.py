"""Triton's sequence control inputs (`sequence_batching { control_input [...] }`): tensors the
server, not the client, gives each request of a sequence, saying whether it starts or ends its
sequence, whether it is a real request, and the sequence's correlation id.

A flag's tensor holds the config's false or true value, typed as the config gives them
(`int32_false_true`, `fp32_false_true`, `bool_false_true`); the correlation id's holds the id
as its `data_type` (UINT64, INT64, UINT32, INT32, or STRING: one BYTES element). Each is
shaped `[1]`, or `[1, 1]` for a model that batches, as Triton shapes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from sluice.shared.datatypes import NUMPY_DTYPE, serialize_bytes_elements
from sluice.shared.errors import InvalidInput, ModelConfigError
from sluice.shared.protocol import Tensor

#: Triton's request parameters of a sequence (the extension's names on the wire).
SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END = "sequence_id", "sequence_start", "sequence_end"
SEQUENCE_PARAMETERS = (SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END)

#: the gRPC InferParameter kinds each may come as.
GRPC_KINDS = {
    SEQUENCE_ID: ("int64_param", "string_param"),
    SEQUENCE_START: ("bool_param",),
    SEQUENCE_END: ("bool_param",),
}
_UINT64_LIMIT = 1 << 64

START = "CONTROL_SEQUENCE_START"
END = "CONTROL_SEQUENCE_END"
READY = "CONTROL_SEQUENCE_READY"
CORRID = "CONTROL_SEQUENCE_CORRID"
#: a flag's config field -> its tensor's datatype.
_FLAG_FIELDS = {"int32_false_true": "INT32", "fp32_false_true": "FP32", "bool_false_true": "BOOL"}


@dataclass(frozen=True, slots=True)
class SequenceControl:
    """One control input as the config declares it."""

    name: str
    #: START, END, READY or CORRID (Triton's `kind`).
    kind: str
    #: the tensor's wire datatype.
    datatype: str
    #: a flag's (false, true) values; empty for CORRID.
    false_true: tuple[Any, ...] = ()

    def array(self, flags: Flags, batched: bool) -> np.ndarray:
        """This control's tensor for a request with `flags`."""
        shape = (1, 1) if batched else (1,)
        if self.kind == CORRID:
            if self.datatype == "BYTES":
                return np.array([str(flags.correlation_id).encode()], dtype=np.object_).reshape(
                    shape
                )
            return np.full(shape, int(flags.correlation_id), NUMPY_DTYPE[self.datatype])
        on = {START: flags.start, END: flags.end, READY: flags.ready}[self.kind]
        return np.full(shape, self.false_true[int(on)], NUMPY_DTYPE[self.datatype])

    def wire(self, flags: Flags, batched: bool) -> Tensor:
        """This control's tensor for a request with `flags`, as a request input."""
        array = self.array(flags, batched)
        if self.datatype == "BYTES":
            data = serialize_bytes_elements(array.reshape(-1))
        else:
            data = array.tobytes()
        return Tensor(self.name, self.datatype, array.shape, data)


@dataclass(frozen=True, slots=True)
class Flags:
    """What the controls say of one request."""

    correlation_id: int | str
    start: bool = False
    end: bool = False
    ready: bool = True


def controls_from_json(sequencing: dict[str, Any]) -> tuple[SequenceControl, ...]:
    """The control inputs of a config's `sequence_batching` as Triton's JSON."""
    controls = []
    for entry in sequencing.get("control_input") or []:
        for control in entry.get("control") or []:
            kind = str(control.get("kind", START))
            if kind == CORRID:
                declared = str(control.get("data_type", "TYPE_UINT64"))
                datatype = "BYTES" if declared == "TYPE_STRING" else declared.removeprefix("TYPE_")
                controls.append(SequenceControl(entry["name"], kind, datatype))
                continue
            field, datatype = next(
                ((f, d) for f, d in _FLAG_FIELDS.items() if control.get(f)), ("", "INT32")
            )
            values = tuple(control.get(field) or (0, 1))
            controls.append(SequenceControl(entry["name"], kind, datatype, values))
    return tuple(controls)


def check_json_parameters(parameters: dict[str, Any]) -> None:
    """A KServe v2 JSON request's sequence parameters as Triton's HTTP endpoint parses them:
    an unsigned integer or a string id, boolean flags (InvalidInput with its message). Triton
    answers these 500 (its JSON reader's errors are INTERNAL); sluice answers bad input 400,
    as it does Triton's other JSON reading errors ('Unable to parse 'shape'')."""
    if SEQUENCE_ID in parameters:
        value = parameters[SEQUENCE_ID]
        unsigned = type(value) is int and 0 <= value < _UINT64_LIMIT
        if not (unsigned or isinstance(value, str)):
            raise InvalidInput(
                f"Unable to parse '{SEQUENCE_ID}': attempt to access JSON non-string as string"
            )
    for flag in (SEQUENCE_START, SEQUENCE_END):
        if flag in parameters and not isinstance(parameters[flag], bool):
            raise InvalidInput(
                f"Unable to parse '{flag}': attempt to access JSON non-boolean as boolean"
            )


def check_grpc_kind(name: str, kind: str | None) -> None:
    """A gRPC request's sequence parameter `name`, sent as `kind`, as Triton's gRPC endpoint
    takes it (InvalidInput with its message)."""
    allowed = GRPC_KINDS[name]
    if kind not in allowed:
        raise InvalidInput(
            f"invalid value type for '{name}' parameter, expected {' or '.join(allowed)}."
        )


def check_sequence_request(model: str, parameters: dict[str, Any], batch_size: int) -> None:
    """What Triton's sequence batcher refuses before it looks a request's sequence up: a
    batch of more than one, a request that names no sequence (InvalidInput, its message)."""
    if batch_size > 1:
        raise InvalidInput(
            f"inference request to model '{model}' must specify batch-size 1 due to "
            "requirements of sequence batcher"
        )
    if not parameters.get(SEQUENCE_ID):
        raise InvalidInput(
            f"inference request to model '{model}' must specify a non-zero or non-empty "
            "correlation ID"
        )


def check_controls(batcher: Any, model: str) -> None:
    """A config's `sequence_batching.control_input`s (the ModelSequenceBatching message) as
    Triton's sequence batcher checks them when the model loads, kind by kind (START, END,
    READY, CORRID): ModelConfigError with its message."""
    for kind in (START, END, READY, CORRID):
        named: set[str] = set()
        seen = False
        for control_input in batcher.control_input:
            if not control_input.name:
                raise ModelConfigError(
                    f"sequence batching control tensor must have a name for {model}"
                )
            if control_input.name in named:
                raise ModelConfigError(
                    f"sequence batching control tensor '{control_input.name}' is specified for "
                    f"multiple control kinds for {model}"
                )
            named.add(control_input.name)
            for control in control_input.control:
                if batcher.Control.Kind.Name(control.kind) != kind:
                    continue
                if seen:
                    raise ModelConfigError(
                        f"sequence batching specifies multiple {kind} tensors for {model}"
                    )
                seen = True
                _check_values(control, kind, model)


def _check_values(control: Any, kind: str, model: str) -> None:
    """A control's false/true values: none for CORRID, one pair of one type for a flag."""
    given = [field for field in _FLAG_FIELDS if len(getattr(control, field))]
    fields = "'int32_false_true', 'fp32_false_true'"
    if kind == CORRID:
        if given:
            raise ModelConfigError(
                f"sequence batching must not specify either {fields} or 'bool_false_true' for "
                f"{kind} for {model}"
            )
        return
    if not given:
        raise ModelConfigError(
            f"sequence batching must specify either {fields} or 'bool_false_true' for {kind} "
            f"for {model}"
        )
    if len(given) > 1:
        raise ModelConfigError(
            f"sequence batching specifies more than one from {fields} and 'bool_false_true' "
            f"for {kind} for {model}"
        )
    if len(getattr(control, given[0])) != 2:
        raise ModelConfigError(
            f"sequence batching control '{given[0]}' must have exactly 2 entries for {kind} "
            f"for {model}"
        )
