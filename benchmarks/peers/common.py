"""What every peer's server shares: sluice's reference MLP run the same way, and a batch counter.

Each peer loads the very TorchScript file sluice serves (examples/model_repository/mlp), on one
intra-op and one inter-op thread as the example's config asks, so the work per batch is the
same everywhere. The counter lets the load generator read the batches a peer executed (peers
have no statistics endpoint): two int64 written in place after every batch.
"""

from __future__ import annotations

import contextlib
import os
import struct

import numpy as np
import torch

COUNTER = struct.Struct("<qq")  # executions, inferences


class Forward:
    """The model on one thread, called with a (rows, 512) float32 array."""

    def __init__(self, model_path: str, counter_path: str) -> None:
        torch.set_num_threads(1)
        with contextlib.suppress(RuntimeError):  # set already in this process
            torch.set_num_interop_threads(1)
        self.model = torch.jit.load(model_path).eval()
        self.executions = self.inferences = 0
        self.counter = os.open(counter_path, os.O_RDWR | os.O_CREAT, 0o644)

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            out = self.model(torch.from_numpy(np.ascontiguousarray(batch, np.float32))).numpy()
        self.executions += 1
        self.inferences += len(batch)
        os.pwrite(self.counter, COUNTER.pack(self.executions, self.inferences), 0)
        return out
