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


def validate_inputs(sig: Signature, inputs: Sequence[Tensor]) -> int:
    """Check names, datatypes, shapes and byte sizes; return the request's batch size."""
    by_name = {t.name: t for t in inputs}
    if len(by_name) != len(inputs):
        raise InvalidInput(f"duplicate input name in request for model '{sig.name}'")
    known = {s.name for s in sig.inputs}
    for name in by_name:
        if name not in known:
            raise InvalidInput(f"unexpected inference input '{name}' for model '{sig.name}'")
    batch: int | None = None
    for spec in sig.inputs:
        tensor = by_name.get(spec.name)
        if tensor is None:
            if spec.optional:
                continue
            raise InvalidInput(f"expected input '{spec.name}' for model '{sig.name}'")
        _check_tensor(sig, spec, tensor)
        if sig.max_batch_size > 0:
            if batch is not None and tensor.shape[0] != batch:
                raise InvalidInput(
                    f"input '{spec.name}' batch size does not match other inputs for '{sig.name}'"
                )
            batch = tensor.shape[0]
    if sig.max_batch_size > 0 and batch is not None and batch > sig.max_batch_size:
        raise InvalidInput(
            f"inference request batch-size must be <= {sig.max_batch_size} for '{sig.name}'"
        )
    return max(1, batch or 1)


def _check_tensor(sig: Signature, spec: IOSpec, tensor: Tensor) -> None:
    if tensor.datatype != spec.datatype:
        raise InvalidInput(
            f"input '{spec.name}': datatype {tensor.datatype} does not match the model's "
            f"{spec.datatype}"
        )
    shape = tensor.shape
    dims = spec.dims
    if sig.max_batch_size > 0:
        if len(shape) == 0 or shape[0] < 1:
            raise InvalidInput(f"input '{spec.name}': shape {list(shape)} lacks a batch dim")
        shape = shape[1:]
    if len(shape) != len(dims) or any(d != -1 and d != s for d, s in zip(dims, shape, strict=True)):
        raise InvalidInput(
            f"input '{spec.name}': unexpected shape {list(tensor.shape)}, model expects "
            f"{sig.full_shape(spec)}"
        )
    if any(s < 0 for s in tensor.shape):
        raise InvalidInput(f"input '{spec.name}': negative dim in shape {list(tensor.shape)}")
    size = ELEMENT_SIZE[spec.datatype]
    nbytes = len(tensor.data) if not isinstance(tensor.data, memoryview) else tensor.data.nbytes
    if size and nbytes != element_count(tensor.shape) * size:
        raise InvalidInput(
            f"input '{spec.name}': got {nbytes} bytes, shape {list(tensor.shape)} of "
            f"{spec.datatype} needs {element_count(tensor.shape) * size}"
        )
