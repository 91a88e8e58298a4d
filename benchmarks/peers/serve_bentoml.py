"""BentoML: one service worker whose batchable API runs the MLP (adaptive batching).

    PEER_MODEL=... PEER_COUNTER=... bentoml serve serve_bentoml:MLP --host 127.0.0.1 --port PORT
    (POST /predict {"data": [[512 floats]]})

BentoML has no batching window to set: its dispatcher fits the batch's cost from what it
measures and waits while waiting pays. max_batch_size is 64; max_latency_ms (a deadline past
which a request is refused, not a window) keeps its default.
"""

from __future__ import annotations

import os

import bentoml
import numpy as np
from common import Forward

MAX_BATCH = 64


@bentoml.service(workers=1)
class MLP:
    def __init__(self) -> None:
        self.forward = Forward(os.environ["PEER_MODEL"], os.environ["PEER_COUNTER"])

    @bentoml.api(batchable=True, max_batch_size=MAX_BATCH)  # type: ignore[misc]
    def predict(self, data: np.ndarray) -> np.ndarray:
        return self.forward(data)
