"""`sluice serve --gateways N`: what a second gateway process on the same ports buys.

An identity model (TorchScript, FP32[512], max batch 64, `max_queue_delay_microseconds: 0`,
one CPU instance, one torch thread) makes the gateway the bottleneck. `sluice serve` (embedded
Redis, one worker) runs it with one gateway and with two sharing the ports (SO_REUSEPORT),
alternating; perf_analyzer (async, batch 1, concurrency 256) drives each over HTTP and gRPC.
Each row gives infer/s, p50 and p99, and the ratio of two gateways to one.

    python benchmarks/gateway_processes.py [--rounds 2] [--concurrency 256]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_triton import perf_analyzer
from shared_memory_bench import PA_WINDOW, RUN_TIMEOUT_S, free_ports, serve_command

MODEL = "identity_2k"
CONFIG = """
name: "identity_2k"
platform: "pytorch_libtorch"
max_batch_size: 64
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 512 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 512 ] } ]
dynamic_batching { max_queue_delay_microseconds: 0 }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters: { key: "INTRA_OP_THREAD_COUNT" value: { string_value: "1" } }
parameters: { key: "INTER_OP_THREAD_COUNT" value: { string_value: "1" } }
"""


def build_repository(folder: Path) -> Path:
    import torch

    class Identity(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    (folder / MODEL / "1").mkdir(parents=True)
    (folder / MODEL / "config.pbtxt").write_text(CONFIG)
    torch.jit.save(torch.jit.script(Identity().eval()), str(folder / MODEL / "1" / "model.pt"))
    return folder


def measure(protocol: str, port: int, level: int, asynchronous: bool = True) -> dict[str, float]:
    pa = perf_analyzer()
    if pa is None:
        raise SystemExit("perf_analyzer not found: set PERF_ANALYZER and PA_LIBDIR")
    url = f"127.0.0.1:{port if protocol == 'http' else port + 1}"
    csv_path = Path(tempfile.mkdtemp(prefix="gw-pa-")) / "out.csv"
    command = [pa[0], "-m", MODEL, "-i", protocol, "-u", url]
    command += ["--async"] if asynchronous else []
    command += ["--concurrency-range", str(level), *PA_WINDOW, "-f", str(csv_path)]
    print("$", shlex.join(command), flush=True)
    run = subprocess.run(command, env=pa[1], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if run.returncode != 0 or not csv_path.exists():
        raise SystemExit((run.stdout + run.stderr)[-2000:])
    row = next(csv.DictReader(csv_path.open()))
    return {
        "infer/s": float(row["Inferences/Second"]),
        "p50": int(row["p50 latency"]) / 1e3,
        "p99": int(row["p99 latency"]) / 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=256)
    args = parser.parse_args()
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = build_repository(Path(tmp))
        for round_ in range(args.rounds):
            for gateways in (1, 2) if round_ % 2 == 0 else (2, 1):
                port = free_ports(18400)
                command = [*serve_command(repo, port), "--gateways", str(gateways)]
                server = subprocess.Popen(command)
                try:
                    wait_ready_for(port)
                    for protocol in ("http", "grpc"):
                        figures = measure(protocol, port, args.concurrency)
                        results.setdefault((protocol, gateways), []).append(figures)
                        print(protocol, gateways, figures, flush=True)
                finally:
                    server.terminate()
                    server.wait(120)
    print(f"\nc={args.concurrency}, perf_analyzer --async, medians of {args.rounds} rounds\n")
    print("| protocol | gateways | infer/s | p50 ms | p99 ms | 2 gateways / 1 |")
    print("|---|---|---|---|---|---|")
    for protocol in ("http", "grpc"):
        one = statistics.median(r["infer/s"] for r in results[(protocol, 1)])
        for gateways in (1, 2):
            rows = results[(protocol, gateways)]
            rate = statistics.median(r["infer/s"] for r in rows)
            p50 = statistics.median(r["p50"] for r in rows)
            p99 = statistics.median(r["p99"] for r in rows)
            ratio = f"{rate / one:.2f}" if gateways == 2 else ""
            print(f"| {protocol} | {gateways} | {rate:,.0f} | {p50:.2f} | {p99:.2f} | {ratio} |")


def wait_ready_for(port: int) -> None:
    deadline_s = time.monotonic() + 300
    while time.monotonic() < deadline_s:
        with contextlib.suppress(OSError):
            url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/ready"
            urllib.request.urlopen(url, timeout=10).close()
            return
        time.sleep(0.2)
    raise SystemExit(f"sluice serve on {port} did not become ready")


if __name__ == "__main__":
    main()
