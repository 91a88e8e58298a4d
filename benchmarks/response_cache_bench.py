"""Triton's response cache under a Zipf-distributed request mix: off, local and Redis.

A catalogue of 1,000 items (random FP32[512] rows for the reference MLP, TorchScript, max batch
64, 1 ms delay) is asked for with Zipf-distributed popularity (exponent 1: item k with weight
1/k) by 64 closed-loop clients. Every round draws a fresh catalogue, so each starts with a cold
cache, and the same sequence of requests goes to three gateways of one fleet in turn (one
worker, one Redis): one without a cache, one with `--cache-config local,size=64MiB` and one with
`--cache-config redis` (the fleet's Redis). A round of 1,700 requests over 1,000 items hits
about 70 % of the time (the first request for an item misses, and so do requests for it made
while that first one runs). The hit rate reported is the
gateway's own count (the model's cache_hit and cache_miss statistics).

    python benchmarks/response_cache_bench.py [--rounds 8] [--requests 1700] [--concurrency 64]
        [--hidden 4096]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from sluice.bench.http import Connection, encode_request
from sluice.embedded_redis import EmbeddedRedis

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "model_repository" / "mlp"
MODEL = "mlp_cached"
CATALOGUE = 1000
ZIPF_EXPONENT = 1.0
CACHES = {"off": None, "local": "local,size=67108864", "redis": "redis"}


def repository(into: Path, hidden: int) -> Path:
    """The reference MLP as `mlp_cached`, with the response cache enabled; with `hidden`, an
    MLP of that width instead (512 -> hidden -> hidden -> 512, seeded: built, not fetched)."""
    model = into / MODEL
    shutil.copytree(MLP, model)
    if hidden:
        torch.manual_seed(0)
        layers = [
            torch.nn.Linear(512, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 512),
        ]
        torch.jit.script(torch.nn.Sequential(*layers).eval()).save(str(model / "1" / "model.pt"))
    config = (model / "config.pbtxt").read_text().replace('name: "mlp"', f'name: "{MODEL}"')
    (model / "config.pbtxt").write_text(config + "\nresponse_cache { enable: true }\n")
    return into


def infer_request(port: int, row: np.ndarray) -> bytes:
    raw = row.astype(np.float32).tobytes()
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT__0",
                    "shape": [1, 512],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    )
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    path = f"/v2/models/{MODEL}/infer"
    return encode_request("POST", f"127.0.0.1:{port}", path, header + raw, headers)


def cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user and system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stats(port: int) -> dict[str, int]:
    url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/stats"
    with urllib.request.urlopen(url, timeout=30) as reply:
        entry = json.loads(reply.read())["model_stats"][0]
    counts = entry["inference_stats"]
    return {k: counts[k]["count"] for k in ("cache_hit", "cache_miss", "success")}


async def drive(port: int, requests: list[bytes], concurrency: int) -> tuple[float, list[int]]:
    """Send every request, `concurrency` at a time; the seconds taken and each latency (ns)."""
    latencies: list[int] = []
    position = iter(range(len(requests)))

    async def client() -> None:
        conn = await Connection("127.0.0.1", port).open()
        try:
            for index in position:
                started = time.perf_counter_ns()
                status, body = await conn.exchange(requests[index])
                if status != 200:
                    raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
                latencies.append(time.perf_counter_ns() - started)
        finally:
            conn.close()

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies


@contextlib.contextmanager
def fleet(repo: Path, redis_url: str, ports: dict[str, int]) -> Iterator[dict[str, int]]:
    """One worker and a gateway per cache mode, stopped at the end: their pids by role."""
    sluice = [sys.executable, "-m", "sluice"]
    processes = [
        subprocess.Popen(
            [*sluice, "worker", "--model-repository", str(repo), "--redis-url", redis_url],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        for mode, port in ports.items():
            cache = CACHES[mode]
            args = [*sluice, "gateway", "--redis-url", redis_url, "--http-port", str(port)]
            args += ["--metrics-port", str(port + 1), "--grpc-port", "0"]
            args += ["--cache-config", cache] if cache else []
            processes.append(
                subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        for port in ports.values():
            wait_ready(port)
        yield {"worker": processes[0].pid} | {
            mode: process.pid for mode, process in zip(ports, processes[1:], strict=True)
        }
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(60)


def wait_ready(port: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/ready"
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        time.sleep(0.1)
    raise RuntimeError(f"gateway on {port}: {MODEL} not ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1700)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--hidden",
        type=int,
        default=0,
        help="an MLP of this width instead of the reference one (a costlier model)",
    )
    args = parser.parse_args()
    ports = {"off": 18300, "local": 18310, "redis": 18320}
    weights = 1.0 / np.arange(1, CATALOGUE + 1) ** ZIPF_EXPONENT
    weights /= weights.sum()
    rng = np.random.default_rng(0)
    totals: dict[str, dict[str, Any]] = {
        mode: {"s": 0.0, "n": 0, "lat": [], "hit": 0, "miss": 0, "gw": 0.0, "wk": 0.0, "cl": 0.0}
        for mode in ports
    }
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        redis = stack.enter_context(EmbeddedRedis())
        pids = stack.enter_context(fleet(repository(Path(tmp), args.hidden), redis.url, ports))
        for port in ports.values():  # one round each first: torch's first calls
            catalogue = rng.standard_normal((CATALOGUE, 512))
            warm = [infer_request(port, catalogue[i]) for i in range(200)]
            asyncio.run(drive(port, warm, args.concurrency))
            stats(port)  # its own figures written before any round counts them
        for round_ in range(args.rounds):
            catalogue = rng.standard_normal((CATALOGUE, 512))
            picks = rng.choice(CATALOGUE, size=args.requests, p=weights)
            order = list(ports.items())
            order = order[round_ % 3 :] + order[: round_ % 3]  # each mode leads in turn
            for mode, port in order:
                requests = [infer_request(port, catalogue[i]) for i in picks]
                before = stats(port)
                cpu = (cpu_s(pids[mode]), cpu_s(pids["worker"]), time.process_time())
                seconds, latencies = asyncio.run(drive(port, requests, args.concurrency))
                total = totals[mode]
                total["gw"] += cpu_s(pids[mode]) - cpu[0]
                total["wk"] += cpu_s(pids["worker"]) - cpu[1]
                total["cl"] += time.process_time() - cpu[2]
                after = stats(port)
                total["s"] += seconds
                total["n"] += len(requests)
                total["lat"] += latencies
                total["hit"] += after["cache_hit"] - before["cache_hit"]
                total["miss"] += after["cache_miss"] - before["cache_miss"]
                print(f"round {round_ + 1} {mode}: {len(requests) / seconds:,.0f} infer/s")
    base = totals["off"]["n"] / totals["off"]["s"]
    print(
        f"\n{args.rounds} rounds of {args.requests} requests, Zipf({ZIPF_EXPONENT}) over "
        f"{CATALOGUE} items, c={args.concurrency}, HTTP binary, "
        f"{f'MLP of width {args.hidden}' if args.hidden else 'reference MLP'}\n"
    )
    print(
        "| cache | infer/s | vs off | p50 ms | p99 ms | hit rate "
        "| CPU µs per request: gateway / worker / client |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode, total in totals.items():
        rate = total["n"] / total["s"]
        p50, p99 = np.percentile(np.array(total["lat"]) / 1e6, [50, 99])
        looked = total["hit"] + total["miss"]
        hits = f"{total['hit'] / looked:.1%}" if looked else "-"
        cpu = " / ".join(f"{total[k] / total['n'] * 1e6:.0f}" for k in ("gw", "wk", "cl"))
        row = f"| {mode} | {rate:,.0f} | {rate / base:.2f}x | {p50:.2f} | {p99:.2f} | {hits} "
        print(f"{row}| {cpu} |")


if __name__ == "__main__":
    main()
