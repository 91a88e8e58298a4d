"""Loading model instances: TorchScript files and plain-Python `model.py` classes.

The python kind has two contracts (documented in docs/models.md). sluice's own: `model.py`
defines a class `Model` whose `__init__(self, context: ModelContext)` loads whatever it needs
and whose `infer(self, inputs: dict[str, torch.Tensor | numpy.ndarray]) -> dict[str,
tensor-like]` computes one stacked batch (BYTES inputs arrive as numpy object arrays of
`bytes`). Triton's: a class `TritonPythonModel` whose `execute` takes the batch's requests one
by one (sluice.workers.python_backend). `model.py` is trusted code: it runs with the worker's
rights.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import ModelSpec
from sluice.workers.python_backend.instance import TritonInstance
from sluice.workers.python_backend.loading import import_model_file, triton_instance

log = logging.getLogger(__name__)

#: a model that computes a stacked batch: named input tensors to named outputs.
TensorFunction = Callable[[dict[str, Any]], dict[str, Any]]
#: one loaded instance: a stacked-batch function, or a Triton Python model's object.
Infer = TensorFunction | TritonInstance


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


def choose_device(spec: ModelSpec) -> torch.device:
    """cuda when the config allows a GPU and one is present, else CPU (with a warning if asked)."""
    wants_gpu = spec.instance_kind in ("KIND_GPU", "KIND_AUTO")
    if wants_gpu and torch.cuda.is_available():
        return torch.device("cuda")
    if spec.instance_kind == "KIND_GPU":
        log.warning("model %r asks for KIND_GPU but no GPU is present: running on CPU", spec.name)
    return torch.device("cpu")


def load_instance(
    spec: ModelSpec, model_dir: Path, version: int, device: torch.device, index: int = 0
) -> Infer:
    """The model's instance number `index` (Triton's instance names count them)."""
    version_dir = model_dir / str(version)
    path = version_dir / spec.model_filename
    if spec.kind == "python":
        return _load_python(spec, model_dir, version, path, device, index)
    if spec.kind == "pytorch":
        return _load_torchscript(spec, path, device)
    raise ModelConfigError(f"{path}: no '{spec.kind}' backend in this worker")


def close_instance(infer: Infer) -> None:
    """Let an instance go: a Triton Python model's `finalize()` runs."""
    if isinstance(infer, TritonInstance):
        infer.close()


def _load_torchscript(spec: ModelSpec, path: Path, device: torch.device) -> TensorFunction:
    try:
        module = torch.jit.load(str(path), map_location=device).eval()
    except (RuntimeError, ValueError, OSError) as exc:
        raise ModelConfigError(f"{path}: cannot load TorchScript model: {exc}") from exc
    order = _argument_order(module, [t.name for t in spec.inputs], path)
    output_names = [t.name for t in spec.outputs]

    def infer(inputs: dict[str, Any]) -> dict[str, Any]:
        result = module(*(inputs[name] for name in order))
        return _name_outputs(result, output_names)

    return infer


_INDEXED = re.compile(r"^.+__(\d+)$")


def _argument_order(module: torch.jit.ScriptModule, names: list[str], path: Path) -> list[str]:
    """Bind config inputs to forward() positions: by argument name, then `NAME__i`, then order."""
    try:
        schema = module.forward.schema  # type: ignore[attr-defined]  # a ScriptMethod's, untyped
        params = [a.name for a in schema.arguments[1:]]
    except AttributeError:
        params = []
    if params and sorted(params) == sorted(names):
        return params
    indexed = [_INDEXED.match(n) for n in names]
    if all(indexed):
        by_index = sorted(zip((int(m.group(1)) for m in indexed if m), names, strict=True))
        return [name for _, name in by_index]
    if params and len(params) != len(names):
        raise ModelConfigError(
            f"{path}: forward() takes {len(params)} inputs {params} but config.pbtxt declares "
            f"{len(names)} {names}"
        )
    return names


def _name_outputs(result: Any, output_names: list[str]) -> dict[str, Any]:
    if isinstance(result, dict):
        return result
    if isinstance(result, torch.Tensor):
        result = (result,)
    indexed = [_INDEXED.match(n) for n in output_names]
    if all(indexed):
        return {n: result[int(m.group(1))] for n, m in zip(output_names, indexed, strict=True) if m}
    return dict(zip(output_names, result, strict=False))


def _load_python(
    spec: ModelSpec, model_dir: Path, version: int, path: Path, device: torch.device, index: int
) -> Infer:
    module = import_model_file(spec.name, version, path, str(index))
    triton_class = getattr(module, "TritonPythonModel", None)
    if triton_class is not None:
        return triton_instance(spec, model_dir, version, device, index, triton_class, path)
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
    infer: TensorFunction = instance.infer
    return infer
