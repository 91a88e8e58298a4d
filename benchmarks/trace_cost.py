"""What Triton-mode tracing costs: no --trace-config, tracing configured at rate 0 (nothing
sampled), and at rate 1,000 (Triton's default: one request in a thousand traced).

The identity model of benchmarks/gateway_processes.py (the gateway is the bottleneck, so a
per-request cost shows); `sluice serve` with each setting in turn, the order rotated each
round; perf_analyzer sync over HTTP at `--concurrency`. Prints infer/s, p50 and the ratio to
no tracing.

    python benchmarks/trace_cost.py [--rounds 3] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_processes import build_repository, measure, wait_ready_for
from shared_memory_bench import free_ports, serve_command


def variants(folder: Path) -> dict[str, list[str]]:
    traced = ["--trace-config", f"triton,file={folder / 'trace.json'}"]
    traced += ["--trace-config", "level=TIMESTAMPS", "--trace-config", "log-frequency=100"]
    return {
        "no tracing": [],
        "rate 0": [*traced, "--trace-config", "rate=0"],
        "rate 1000": [*traced, "--trace-config", "rate=1000"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = build_repository(Path(tmp) / "models")
        settings = variants(Path(tmp))
        names = list(settings)
        for round_ in range(args.rounds):
            first = round_ % len(names)
            for name in names[first:] + names[:first]:
                port = free_ports(18450)
                command = [*serve_command(repo, port), "--gateways", "1", *settings[name]]
                server = subprocess.Popen(command)
                try:
                    wait_ready_for(port)
                    figures = measure("http", port, args.concurrency, asynchronous=False)
                    results.setdefault(name, []).append(figures)
                    print(name, figures, flush=True)
                finally:
                    server.terminate()
                    server.wait(120)
    base = statistics.median(r["infer/s"] for r in results["no tracing"])
    print(f"\nperf_analyzer sync over HTTP, c={args.concurrency}, medians of {args.rounds}\n")
    print("| tracing | infer/s | p50 ms | ÷ no tracing |")
    print("|---|---|---|---|")
    for name in names:
        rate = statistics.median(r["infer/s"] for r in results[name])
        p50 = statistics.median(r["p50"] for r in results[name])
        print(f"| {name} | {rate:,.0f} | {p50:.2f} | {rate / base:.3f} |")


if __name__ == "__main__":
    main()
