"""Whether the C tools on the hot path pay off: orjson, hiredis and uvloop against the stdlib.

Each pair does the same work the gateway does per request (JSON of an infer header and a
response, a Redis round trip carrying a batch of replies, event-loop scheduling), in one run.

    python benchmarks/hot_path_tools.py
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import numpy as np
import orjson
import redis
import uvloop
from redis._parsers import _HiredisParser, _RESP2Parser
from sluice.shared.protocol import Result, Tensor, encode_results

from sluice.embedded_redis import EmbeddedRedis

REQUEST = {
    "id": "42",
    "inputs": [
        {
            "name": "INPUT__0",
            "shape": [1, 512],
            "datatype": "FP32",
            "parameters": {"binary_data_size": 2048},
        }
    ],
    "parameters": {"binary_data_output": True},
}
RESPONSE_OUTPUT = np.random.rand(512).astype(np.float32)


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    start_s = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start_s) / calls * 1e6


def json_figures() -> list[tuple[str, float, float]]:
    header = json.dumps(REQUEST).encode()
    response = {
        "model_name": "mlp",
        "model_version": "1",
        "outputs": [
            {"name": "OUTPUT__0", "datatype": "FP32", "shape": [1, 512], "data": RESPONSE_OUTPUT}
        ],
    }
    as_list = {
        **response,
        "outputs": [{**response["outputs"][0], "data": RESPONSE_OUTPUT.tolist()}],
    }
    return [
        (
            "parse an infer header",
            per_call_us(lambda: json.loads(header), 50_000),
            per_call_us(lambda: orjson.loads(header), 50_000),
        ),
        (
            "JSON response, 512 floats",
            per_call_us(lambda: json.dumps(as_list), 5_000),
            per_call_us(lambda: orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY), 5_000),
        ),
    ]


def redis_figures(url: str) -> tuple[str, float, float]:
    results = [
        Result(f"gw:{i}", [Tensor("OUTPUT__0", "FP32", (1, 512), RESPONSE_OUTPUT.tobytes())])
        for i in range(32)
    ]
    setup = redis.Redis.from_url(url)
    setup.delete("bench:replies")
    for _ in range(4):
        setup.xadd("bench:replies", encode_results(results))
    timings = []
    for parser in (_RESP2Parser, _HiredisParser):
        client = redis.Redis.from_url(url, parser_class=parser)
        timings.append(per_call_us(lambda c=client: c.xread({"bench:replies": "0-0"}), 2_000))
        client.close()
    setup.close()
    return "XREAD of 4 reply entries (32 results each)", timings[0], timings[1]


def loop_figures() -> tuple[str, float, float]:
    async def churn() -> float:
        loop = asyncio.get_running_loop()
        start_s, n = time.perf_counter(), 100_000
        for _ in range(n // 1000):
            futures = [loop.create_future() for _ in range(1000)]
            for f in futures:
                loop.call_soon(f.set_result, None)
            await asyncio.gather(*futures)
        return (time.perf_counter() - start_s) / n * 1e6

    stdlib = asyncio.run(churn())
    fast = uvloop.run(churn())
    return "resolve a future through the event loop", stdlib, fast


def main() -> None:
    rows = json_figures()
    with EmbeddedRedis() as server:
        rows.append(redis_figures(server.url))
    rows.append(loop_figures())
    print(f"{'work':46s} {'stdlib µs':>10s} {'C tool µs':>10s} {'gain':>6s}")
    for name, slow, fast in rows:
        print(f"{name:46s} {slow:10.2f} {fast:10.2f} {slow / fast:6.1f}x")


if __name__ == "__main__":
    main()
