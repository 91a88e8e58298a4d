"""What tracing costs: no --trace-config, tracing configured at rate 0 (nothing sampled), and
at rate 1,000 (Triton's default: one request in a thousand traced), in Triton's mode (a trace
file) and in OpenTelemetry's (spans exported to an OTLP receiver on loopback).

The identity model of benchmarks/gateway_processes.py (the gateway is the bottleneck, so a
per-request cost shows); `sluice serve` with each setting in turn, the order rotated each
round; perf_analyzer sync over HTTP at `--concurrency`. Prints infer/s, p50 and the ratio to
no tracing.

    python benchmarks/trace_cost.py [--rounds 3] [--concurrency 16] [--only 'opentelemetry, rate 0']
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gateway_processes import build_repository, measure, wait_ready_for
from shared_memory_bench import free_ports, serve_command

from tests.otlp_receiver import OtlpReceiver


def variants(folder: Path, otlp_url: str) -> dict[str, list[str]]:
    traced = ["--trace-config", f"triton,file={folder / 'trace.json'}"]
    traced += ["--trace-config", "level=TIMESTAMPS", "--trace-config", "log-frequency=100"]
    otel = ["--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS"]
    otel += ["--trace-config", f"opentelemetry,url={otlp_url}"]
    return {
        "no tracing": [],
        "triton, rate 0": [*traced, "--trace-config", "rate=0"],
        "triton, rate 1000": [*traced, "--trace-config", "rate=1000"],
        "opentelemetry, rate 0": [*otel, "--trace-config", "rate=0"],
        "opentelemetry, rate 1000": [*otel, "--trace-config", "rate=1000"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--only", action="append", help="measure these settings alone (repeat; 'no tracing' too)"
    )
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    receiver = OtlpReceiver()
    with tempfile.TemporaryDirectory() as tmp:
        repo = build_repository(Path(tmp) / "models")
        settings = variants(Path(tmp), receiver.url)
        names = [n for n in settings if n == "no tracing" or not args.only or n in args.only]
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
    receiver.close()
    print(f"\nspans received over OTLP: {len(receiver.spans):,}")
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
