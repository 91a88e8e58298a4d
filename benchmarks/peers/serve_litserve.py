"""LitServe: batching on (max_batch_size 64, batch_timeout 1 ms), one CPU inference worker.

Started as:

    python serve_litserve.py MODEL_PT COUNTER PORT  (POST /predict {"data": [[512 floats]]})
"""

from __future__ import annotations

import sys

import litserve as ls
import numpy as np
from common import Forward

MAX_BATCH = 64
TIMEOUT_S = 0.001


class MLP(ls.LitAPI):  # type: ignore[misc]
    def __init__(self, model_path: str, counter_path: str) -> None:
        super().__init__(max_batch_size=MAX_BATCH, batch_timeout=TIMEOUT_S)
        self.paths = model_path, counter_path

    def setup(self, device: str) -> None:
        self.forward = Forward(*self.paths)

    # LitServe types its route by these two annotations: none is its plain JSON path
    def decode_request(self, request):  # type: ignore[no-untyped-def]
        return np.asarray(request["data"], dtype=np.float32)

    def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(inputs)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.forward(x)

    def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
        return list(output)

    def encode_response(self, output: np.ndarray):  # type: ignore[no-untyped-def]
        return [output.tolist()]


def main() -> None:
    model_path, counter_path, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    server = ls.LitServer(MLP(model_path, counter_path), accelerator="cpu", workers_per_device=1)
    server.run(host="127.0.0.1", port=port, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
