"""Ray Serve: one replica whose `@serve.batch` method runs the MLP, behind Serve's HTTP proxy
and its gRPC proxy.

    python serve_ray.py MODEL_PT COUNTER PORT      (POST /predict {"data": [[512 floats]]})

On PORT + 1, Serve's gRPC proxy takes KServe's `ModelInfer` (Triton's protobuf, from the
tritonclient package): Ray Serve's own way to serve gRPC, a servicer whose methods are the
deployment's, so that a gRPC client drives it as it drives sluice and PyTriton.

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
from ray.serve.config import gRPCOptions
from starlette.requests import Request
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb

MAX_BATCH = 64
WAIT_S = 0.001
WIDTH = 512
SERVICER = "tritonclient.grpc.service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server"


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

    async def ModelInfer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        rows = np.frombuffer(request.raw_input_contents[0], np.float32).reshape(-1, WIDTH)
        out = np.ascontiguousarray(await self.infer(rows), np.float32).reshape(len(rows), -1)
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name="OUTPUT__0", datatype="FP32", shape=list(out.shape))
        response.raw_output_contents.append(out.tobytes())
        return response

    # what perf_analyzer asks before its load: the server, the model's signature and batching
    async def ServerMetadata(self, request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="ray-serve", version=ray.__version__)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        response = pb.ModelMetadataResponse(name=request.name, versions=["1"], platform="ray")
        response.inputs.add(name="INPUT__0", datatype="FP32", shape=[-1, WIDTH])
        response.outputs.add(name="OUTPUT__0", datatype="FP32", shape=[-1, WIDTH])
        return response

    async def ModelConfig(self, request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
        config = mc.ModelConfig(name=request.name, max_batch_size=MAX_BATCH)
        config.input.add(name="INPUT__0", data_type=mc.TYPE_FP32, dims=[WIDTH])
        config.output.add(name="OUTPUT__0", data_type=mc.TYPE_FP32, dims=[WIDTH])
        return pb.ModelConfigResponse(config=config)


def main() -> None:
    model_path, counter_path, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=os.cpu_count(),
        object_store_memory=256 << 20,
        log_to_driver=False,
    )
    serve.start(
        http_options={"host": "127.0.0.1", "port": port},
        grpc_options=gRPCOptions(port=port + 1, grpc_servicer_functions=[SERVICER]),
    )
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
