"""Python models (`backend: "python"`, `model.py`), under either of two contracts (documented
in docs/models.md).

sluice's own: `model.py` defines a class `Model` whose `__init__(self, context: ModelContext)`
loads whatever it needs and whose `infer(self, inputs: dict[str, torch.Tensor |
numpy.ndarray]) -> dict[str, tensor-like]` computes one stacked batch (BYTES inputs arrive as
numpy object arrays of `bytes`). Triton's: a class `TritonPythonModel` whose `execute` takes
the batch's requests one by one (sluice.workers.python_backend). `model.py` is trusted code:
it runs with the worker's rights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import ModelSpec
from sluice.workers.instances.generative import GenerativeInstance
from sluice.workers.instances.model_instance import GenerativeModel, ModelInstance, Responses
from sluice.workers.instances.stacked import StackedInstance
from sluice.workers.python_backend.instance import TritonInstance
from sluice.workers.python_backend.iterative import TritonIterative
from sluice.workers.python_backend.loading import (
    complete_config,
    import_model_file,
    triton_instance,
)

__all__ = ["ModelContext", "complete_config", "load_instance"]


@dataclass(frozen=True, slots=True)
class ModelContext:
    """What a python model's constructor gets."""

    name: str
    version: int
    model_dir: Path
    version_dir: Path
    device: torch.device
    config: Mapping[str, Any]
    parameters: Mapping[str, str]


def load_instance(
    spec: ModelSpec, model_dir: Path, version: int, device: torch.device, index: int
) -> ModelInstance:
    """A `TritonPythonModel` object, or a `Model` whose `infer` runs stacked batches; either
    generative under an iterative config."""
    path = model_dir / str(version) / spec.model_filename
    module = import_model_file(spec.name, version, path, str(index))
    triton_class = getattr(module, "TritonPythonModel", None)
    if triton_class is not None:
        triton = triton_instance(spec, model_dir, version, device, index, triton_class, path)
        return _triton_iterative(spec, triton, path) if spec.config.iterative_sequence else triton
    model_class = getattr(module, "Model", None)
    if model_class is None:
        raise ModelConfigError(
            f"{path}: defines no class `Model` (sluice's contract) nor `TritonPythonModel` "
            "(Triton's Python backend)"
        )
    context = ModelContext(
        spec.name,
        version,
        model_dir,
        model_dir / str(version),
        device,
        spec.config_json,
        spec.parameters,
    )
    try:
        instance = model_class(context)
    except Exception as exc:  # user code
        raise ModelConfigError(f"{path}: Model() failed: {exc!r}") from exc
    if spec.config.iterative_sequence:
        return _generative(spec, instance, path)
    return StackedInstance(spec, instance.infer, device)


def _triton_iterative(spec: ModelSpec, triton: TritonInstance, path: Path) -> GenerativeInstance:
    """A `TritonPythonModel` stepped by in-flight batching (Triton's iterative sequences)."""

    def model_for(responses: Responses) -> GenerativeModel:
        return TritonIterative(triton, responses, spec)

    _check_iterative(spec, path)
    return GenerativeInstance(model_for, triton.close, spec.name)


def _generative(spec: ModelSpec, instance: object, path: Path) -> GenerativeInstance:
    """A `Model` with the generative contract, for an iterative config (in-flight batching)."""
    if not isinstance(instance, GenerativeModel):
        raise ModelConfigError(
            f"{path}: model '{spec.name}' is iterative (sequence_batching "
            "{ iterative_sequence: true }): its Model needs prefill, step, join and keep"
        )
    model: GenerativeModel = instance
    _check_iterative(spec, path)
    return GenerativeInstance(lambda _responses: model, _closer(model), spec.name)


def _check_iterative(spec: ModelSpec, path: Path) -> None:
    if not spec.config.decoupled or spec.max_batch_size < 1:
        raise ModelConfigError(
            f"{path}: model '{spec.name}' is iterative: it must be decoupled "
            "(model_transaction_policy { decoupled: true }), one response per token, and set "
            "max_batch_size, the sequences an instance runs together"
        )


def _closer(model: object) -> Callable[[], None]:
    """The model's own `close`, if it has one."""
    close: Callable[[], None] = getattr(model, "close", lambda: None)
    return close
