"""A fake generative model for the in-flight tests: each sequence counts 1, 2, ... up to the
length its request asks for."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sluice.shared.protocol import Request, Tensor
from sluice.workers.instances.model_instance import Prompt

SPEC_DIR = "counter"
CONFIG = """
name: "counter"
backend: "python"
max_batch_size: 4
input [ { name: "LENGTH", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "TOKEN", data_type: TYPE_INT32, dims: [ 1 ] } ]
sequence_batching { iterative_sequence: true }
model_transaction_policy { decoupled: true }
"""


class Counter:
    """Each sequence counts 1, 2, ... and stops at its LENGTH; the state is [count, length]."""

    def __init__(self) -> None:
        self.fail_prefill_at: int | None = None
        self.fail_step = False
        self.fail_join = False

    def prefill(self, prompts: Sequence[Prompt]) -> np.ndarray:
        lengths = [int(p.inputs["LENGTH"].reshape(-1)[0]) for p in prompts]
        if self.fail_prefill_at in lengths:
            raise RuntimeError("bad prompt")
        return np.array([[0, n] for n in lengths], dtype=np.int32)

    def step(self, state: np.ndarray) -> tuple[Mapping[str, Any], Sequence[bool]]:
        if self.fail_step:
            raise RuntimeError("step failed")
        state[:, 0] += 1
        return {"TOKEN": state[:, :1].copy()}, list(state[:, 0] >= state[:, 1])

    def join(self, state: np.ndarray, joining: np.ndarray) -> np.ndarray:
        if self.fail_join:
            raise RuntimeError("join failed")
        return np.concatenate([state, joining])

    def keep(self, state: np.ndarray, rows: list[int]) -> np.ndarray:
        return state[rows]


def request(rid: str, length: int, **parameters: Any) -> Request:
    data = np.array([[length]], dtype=np.int32).tobytes()
    return Request(rid, 1, 0, "", [Tensor("LENGTH", "INT32", (1, 1), data)], None, parameters)
