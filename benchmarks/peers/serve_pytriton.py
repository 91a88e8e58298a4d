"""PyTriton: Triton's C++ server and dynamic batcher, the MLP in this Python process.

    python serve_pytriton.py MODEL_PT COUNTER PORT   (HTTP on PORT, gRPC PORT+1, metrics PORT+2)

Same tensor names as sluice's example config, so both take the same KServe v2 bodies.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

import numpy as np
from common import Forward
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import (
    DEFAULT_PROTECTED_ENDPOINTS,
    Triton,
    TritonConfig,
    TritonSecurityConfig,
)

MAX_BATCH = 64
DELAY_US = 1000


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # PyTriton shuts its server down on KeyboardInterrupt


def main() -> None:
    model_path, counter_path, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    forward = Forward(model_path, counter_path)

    @batch  # type: ignore[misc]
    def infer(INPUT__0: np.ndarray) -> dict[str, np.ndarray]:
        return {"OUTPUT__0": forward(INPUT__0)}

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=port,
        grpc_address="127.0.0.1",
        grpc_port=port + 1,
        metrics_address="127.0.0.1",
        metrics_port=port + 2,
        allow_gpu_metrics=False,
    )
    batching = ModelConfig(
        max_batch_size=MAX_BATCH, batcher=DynamicBatcher(max_queue_delay_microseconds=DELAY_US)
    )
    # statistics open, as in Triton itself, since perf_analyzer reads them (loopback only)
    security = TritonSecurityConfig(
        restricted_endpoints=[e for e in DEFAULT_PROTECTED_ENDPOINTS if e != "statistics"]
    )
    with Triton(config=config, security_config=security) as triton:
        triton.bind(
            model_name="mlp",
            infer_func=infer,
            inputs=[Tensor(name="INPUT__0", dtype=np.float32, shape=(512,))],
            outputs=[Tensor(name="OUTPUT__0", dtype=np.float32, shape=(512,))],
            config=batching,
            strict=True,
        )
        triton.serve()


if __name__ == "__main__":
    main()
