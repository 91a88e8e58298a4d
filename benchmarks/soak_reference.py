"""The soak's reference: a pool of random inputs and the model's own outputs for them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class ModelIO:
    input_name: str
    output_name: str
    row_shape: tuple[int, ...]


@dataclass(frozen=True)
class Pool:
    inputs: np.ndarray  # (n, *row_shape) float32
    outputs: np.ndarray  # (n, *out_shape) float32


def model_file(repository: Path, model: str) -> Path:
    versions = sorted(
        (int(p.name), p) for p in (repository / model).iterdir() if p.is_dir() and p.name.isdigit()
    )
    for _, folder in reversed(versions):
        if (folder / "model.pt").exists():
            return folder / "model.pt"
    raise SystemExit(f"no <N>/model.pt under {repository / model}: build the models first")


def reference_pool(path: Path, row_shape: tuple[int, ...], size: int, seed: int) -> Pool:
    """`size` distinct random inputs and their outputs, one row at a time, torch 1 thread."""
    import torch

    torch.set_num_threads(1)
    module = torch.jit.load(str(path), map_location="cpu").eval()
    rng = np.random.default_rng(seed)
    inputs = rng.standard_normal((size, *row_shape)).astype(np.float32)
    with torch.no_grad():
        rows = [module(torch.from_numpy(inputs[i : i + 1])).numpy()[0] for i in range(size)]
    return Pool(inputs, np.stack(rows).astype(np.float32))
