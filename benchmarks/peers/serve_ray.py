"""Ray Serve: one replica whose `@serve.batch` method runs the MLP, behind Serve's HTTP proxy.

    python serve_ray.py MODEL_PT COUNTER PORT      (POST /predict {"data": [[512 floats]]})

Ray is kept on loopback: its node IP is 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps
ray.init from swapping 127.0.0.1 for the machine's own address), no dashboard, no usage
reports. A replica takes `max_ongoing_requests` requests at a time (5 by default), which caps
its batches at 5: it is raised to the largest batch.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np
import ray
from common import Forward
from ray import serve
from starlette.requests import Request

MAX_BATCH = 64
WAIT_S = 0.001


@serve.deployment(num_replicas=1, max_ongoing_requests=MAX_BATCH)
class MLP:
    def __init__(self, model_path: str, counter_path: str) -> None:
        self.forward = Forward(model_path, counter_path)

    @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=WAIT_S)  # type: ignore[misc]
    async def infer(self, rows: list[np.ndarray]) -> list[np.ndarray]:
        return list(self.forward(np.concatenate(rows)))

    async def __call__(self, request: Request) -> list[Any]:
        rows = np.asarray((await request.json())["data"], dtype=np.float32)
        return [(await self.infer(rows)).tolist()]


def main() -> None:
    model_path, counter_path, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=os.cpu_count(),
        object_store_memory=256 << 20,
        log_to_driver=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(MLP.bind(model_path, counter_path), name="mlp", route_prefix="/predict")
    print("node ip", ray.util.get_node_ip_address(), flush=True)
    stopping: list[int] = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: stopping.append(signum))
    while not stopping:
        signal.pause()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
