"""A closed-loop gRPC load for machines without perf_analyzer (the lent GPU machine): `level`
calls of `ModelInfer` in flight, spread over client processes and HTTP/2 connections of their
own (so that gateways sharing a port, `--gateways N`, each get some), for `seconds`. The
request is serialized once; responses are not parsed. Each figure is the whole run's.

    python benchmarks/grpc_load.py 127.0.0.1:8001 mlp 64 --width 512 [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb

METHOD = "/inference.GRPCInferenceService/ModelInfer"
#: calls one client process keeps in flight at most, and on one connection.
CALLS_PER_PROCESS = 64
CALLS_PER_CONNECTION = 8


def request_bytes(model: str, width: int) -> bytes:
    """A ModelInferRequest of one FP32 row of `width`, as INPUT__0 (the benchmarks' MLPs)."""
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, width])
    request.raw_input_contents.append(np.ones((1, width), np.float32).tobytes())
    return bytes(request.SerializeToString())


async def _calls(target: str, body: bytes, level: int, seconds: float) -> list[int]:
    """Each call's latency (ns), `level` in flight, over connections of CALLS_PER_CONNECTION."""
    channels = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(max(1, level // CALLS_PER_CONNECTION))
    ]
    latencies: list[int] = []
    end = time.monotonic() + seconds

    async def loop(channel: Any) -> None:
        call = channel.unary_unary(METHOD)
        while time.monotonic() < end:
            started = time.perf_counter_ns()
            await call(body)
            latencies.append(time.perf_counter_ns() - started)

    await asyncio.gather(*(loop(channels[i % len(channels)]) for i in range(level)))
    for channel in channels:
        await channel.close()
    return latencies


def _process(args: tuple[str, bytes, int, float]) -> list[int]:
    return asyncio.run(_calls(*args))


def grpc_load(target: str, model: str, width: int, level: int, seconds: float) -> dict[str, Any]:
    """infer/s, p50 and p99 (ms) of `level` calls in flight for `seconds`."""
    body = request_bytes(model, width)
    shares = [CALLS_PER_PROCESS] * (level // CALLS_PER_PROCESS)
    if level % CALLS_PER_PROCESS:
        shares.append(level % CALLS_PER_PROCESS)
    context = multiprocessing.get_context("spawn")
    try:
        with context.Pool(len(shares)) as pool:
            runs = pool.map(_process, [(target, body, share, seconds) for share in shares])
    except grpc.RpcError as exc:
        return {"error": f"{exc.code()}: {exc.details()}"}
    latencies = sorted(ns for run in runs for ns in run)
    if not latencies:
        return {"error": "no call answered"}
    return {
        "throughput": len(latencies) / seconds,
        "p50_ms": statistics.median(latencies) / 1e6,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("model")
    parser.add_argument("level", type=int)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    print(grpc_load(args.target, args.model, args.width, args.level, args.seconds))


if __name__ == "__main__":
    main()
