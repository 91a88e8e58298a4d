"""A model's input/output signature as both sides see it, and request validation against it.

Built from the Triton-style config JSON that workers publish, so a gateway needs neither the
model repository nor torch. Validation happens at the gateway (a 400 naming the field) and
again in the worker, so a bad request never reaches a batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.shared.datatypes import ELEMENT_SIZE, config_to_wire, element_count
from sluice.shared.errors import InvalidInput
from sluice.shared.protocol import Tensor


@dataclass(frozen=True, slots=True)
class IOSpec:
    name: str
    datatype: str
    #: dims without the implicit batch dim; -1 = variable.
    dims: tuple[int, ...]
    optional: bool = False


@dataclass(frozen=True, slots=True)
class Signature:
    name: str
    max_batch_size: int
    inputs: tuple[IOSpec, ...]
    outputs: tuple[IOSpec, ...]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Signature:
        def specs(items: Sequence[Mapping[str, Any]]) -> tuple[IOSpec, ...]:
            return tuple(
                IOSpec(
                    str(i["name"]),
                    config_to_wire(str(i["data_type"])),
                    tuple(int(d) for d in i["dims"]),
                    bool(i.get("optional", False)),
                )
                for i in items
            )

        return cls(
            str(config["name"]),
            int(config.get("max_batch_size", 0)),
            specs(config.get("input", [])),
            specs(config.get("output", [])),
        )

    def full_shape(self, spec: IOSpec) -> list[int]:
        """The shape clients see: with a leading -1 batch dim when the model batches."""
        return [-1, *spec.dims] if self.max_batch_size > 0 else list(spec.dims)

    def output_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outputs)


#: what Triton adds to a shape error when the model batches
BATCH_DIM_NOTE = (
    " NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to"
    " be prepended to each input shape. If you want to specify the full shape including the"
    " batch dim in your input dims config, try setting max_batch_size to zero. See the model"
    " configuration docs for more info on max_batch_size."
)


def _names(names: Sequence[str]) -> str:
    """A list of names as Triton prints one: ['A','B'] (and, empty, a lone ']')."""
    return ("[" + "".join(f"'{n}'," for n in names))[:-1] + "]"


def _dims(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def validate_inputs(sig: Signature, inputs: Sequence[Tensor], request_id: str = "") -> int:
    """Check names, datatypes, shapes and byte sizes in Triton's order, with its texts (they
    name the request as Triton does); return the request's batch size."""
    at = f"[request id: {request_id or '<id_unknown>'}] "
    by_name: dict[str, Tensor] = {}
    for t in inputs:
        if t.name in by_name:
            raise InvalidInput(f"{at}input '{t.name}' already exists in request")
        by_name[t.name] = t
    if len(inputs) != len(sig.inputs) and not any(s.optional for s in sig.inputs):
        missing = [s.name for s in sig.inputs if s.name not in by_name]
        raise InvalidInput(
            f"{at}expected {len(sig.inputs)} inputs but got {len(inputs)} inputs for model "
            f"'{sig.name}'. Got input(s) {_names(list(by_name))}, but missing required input(s) "
            f"{_names(missing)}. Please provide all required input(s)."
        )
    known = {s.name for s in sig.inputs}
    for name in by_name:
        if name not in known:
            raise InvalidInput(f"unexpected inference input '{name}' for model '{sig.name}'")
    for spec in sig.inputs:
        if spec.name not in by_name and not spec.optional:
            raise InvalidInput(f"expected input '{spec.name}' for model '{sig.name}'")
    batch = _batch_size(sig, by_name, at)
    for spec in sig.inputs:
        if (tensor := by_name.get(spec.name)) is not None:
            _check_tensor(sig, spec, tensor, at)
    return batch


def _batch_size(sig: Signature, by_name: Mapping[str, Tensor], at: str) -> int:
    """The requests' batch (1 for a model that does not batch): every input's first dim, the
    same for all and at most the model's max_batch_size."""
    if sig.max_batch_size <= 0:
        return 1
    batch: int | None = None
    for spec in sig.inputs:
        tensor = by_name.get(spec.name)
        if tensor is None:
            continue
        if len(tensor.shape) == 0 or tensor.shape[0] < 1:
            raise InvalidInput(f"input '{spec.name}': shape {list(tensor.shape)} lacks a batch dim")
        if batch is not None and tensor.shape[0] != batch:
            raise InvalidInput(
                f"{at}input '{spec.name}' batch size does not match other inputs for '{sig.name}'"
            )
        batch = tensor.shape[0]
    if batch is not None and batch > sig.max_batch_size:
        raise InvalidInput(
            f"{at}inference request batch-size must be <= {sig.max_batch_size} for '{sig.name}'"
        )
    return max(1, batch or 1)


def _check_tensor(sig: Signature, spec: IOSpec, tensor: Tensor, at: str) -> None:
    if tensor.datatype != spec.datatype:
        raise InvalidInput(
            f"{at}inference input '{spec.name}' data-type is '{tensor.datatype}', but model "
            f"'{sig.name}' expects '{spec.datatype}'"
        )
    shape = tensor.shape[1:] if sig.max_batch_size > 0 else tensor.shape
    dims = spec.dims
    if len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape, strict=True)):
        raise InvalidInput(
            f"{at}unexpected shape for input '{spec.name}' for model '{sig.name}'. Expected "
            f"{_dims(sig.full_shape(spec))}, got {_dims(tensor.shape)}."
            + (BATCH_DIM_NOTE if sig.max_batch_size > 0 else "")
        )
    if any(s < 0 for s in tensor.shape):
        raise InvalidInput(f"input '{spec.name}': negative dim in shape {list(tensor.shape)}")
    size = ELEMENT_SIZE[spec.datatype]
    nbytes = len(tensor.data) if not isinstance(tensor.data, memoryview) else tensor.data.nbytes
    if size and nbytes != element_count(tensor.shape) * size:
        raise InvalidInput(
            f"{at}input byte size mismatch for input '{spec.name}' for model '{sig.name}'. "
            f"Expected {element_count(tensor.shape) * size}, got {nbytes}"
        )
