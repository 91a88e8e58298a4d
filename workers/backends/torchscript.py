"""TorchScript models (`platform: "pytorch_libtorch"`, `model.pt`), as Triton's PyTorch backend
binds them: config inputs to forward()'s arguments, outputs to its results."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import ModelSpec
from sluice.workers.instances.stacked import TensorFunction

_INDEXED = re.compile(r"^.+__(\d+)$")


def load_instance(
    spec: ModelSpec, model_dir: Path, version: int, device: torch.device, index: int
) -> TensorFunction:
    """The TorchScript module on `device`, as a stacked-batch function."""
    path = model_dir / str(version) / spec.model_filename
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
