"""How much slower the reference MLP's batch-1 forward runs when other work came between.

At batch 1 the MLP reads its 24 MB of weights once per call, so its time is where those
weights are: back to back they stay in the last-level cache; on a server, the gateway,
Redis, the load generator and other tenants of the machine run between two requests and
evict part of them. This times the forward back to back (as the model-alone figure of
`compare_triton.py` does), after an idle gap as long as a request's trip around it at c=1,
and after reading a given amount of other memory (one thread, torch on one thread).

    python benchmarks/model_in_place.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

MODEL = Path(__file__).resolve().parent.parent / "examples/model_repository/mlp/1/model.pt"
ROUNDS = 400
GAP_S = 0.0015
MB = (0.5, 1, 2, 4, 16)


def forward_us(model: torch.jit.ScriptModule, between: Callable[[], object]) -> float:
    """Median time of one batch-1 forward, each preceded by `between()`."""
    x = torch.randn(1, 512)
    times_s = []
    with torch.inference_mode():
        for _ in range(20):
            model(x)
        for _ in range(ROUNDS):
            between()
            start_s = time.perf_counter()
            model(x)
            times_s.append(time.perf_counter() - start_s)
    return statistics.median(times_s) * 1e6


def main() -> None:
    torch.set_num_threads(1)
    model = torch.jit.load(str(MODEL)).eval()
    other = np.ones(int(max(MB) * 2**20 / 4), dtype=np.float32)
    alone_us = forward_us(model, lambda: None)
    print(f"back to back: {alone_us:.0f} µs")
    idle_us = forward_us(model, lambda: time.sleep(GAP_S))
    print(f"after {GAP_S * 1e3:.1f} ms idle: {idle_us:.0f} µs ({idle_us / alone_us:.2f}x)")
    for mb in MB:
        part = other[: int(mb * 2**20 / 4)]
        after_us = forward_us(model, part.sum)
        print(
            f"after reading {mb:g} MB of other memory: {after_us:.0f} µs "
            f"({after_us / alone_us:.2f}x)"
        )


if __name__ == "__main__":
    main()
