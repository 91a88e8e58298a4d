"""Where a machine's cores go while sluice serves the reference MLP at one concurrency.

`sluice serve` (embedded Redis, one worker, one gateway) on the example MLP; perf_analyzer
(sync, HTTP or gRPC) at `--concurrency`. Each process's CPU time over the run (from /proc),
per inference: the gateway, the worker (its model thread apart, from the model's own compute
time in the statistics), Redis and perf_analyzer. Against the model's own throughput at the
batch size served (measured alone before the run), this says how far the model-bound goal
(0.8 of the model's own throughput) is from what the machine's cores can give.

    python benchmarks/cpu_budget.py [--protocol http] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_triton import EXAMPLES, mlp_repository, perf_analyzer
from shared_memory_bench import RUN_TIMEOUT_S, free_ports, serve_command

PA_WINDOW = ["-p", "5000", "-s", "50", "-r", "5"]
ALONE_S = 3.0


def model_alone(batch: int) -> float:
    """Inferences per second of the MLP alone at `batch`, one torch thread."""
    torch.set_num_threads(1)
    model = torch.jit.load(str(EXAMPLES / "mlp" / "1" / "model.pt")).eval()
    rows = torch.rand(batch, 512)
    with torch.inference_mode():
        for _ in range(20):
            model(rows)
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < ALONE_S:
            model(rows)
            runs += 1
    return runs * batch / (time.perf_counter() - start)


def stats(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/mlp/stats", timeout=10) as r:
        model = json.load(r)["model_stats"][0]
    return {
        "inferences": model["inference_count"],
        "executions": model["execution_count"],
        "compute_ns": model["inference_stats"]["compute_infer"]["ns"],
    }


def cpu_s(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    pa = perf_analyzer()
    if pa is None:
        raise SystemExit("perf_analyzer not found: set PERF_ANALYZER and PA_LIBDIR")
    repo = mlp_repository(lambda config: config)
    port = free_ports(18800)
    server = subprocess.Popen([*serve_command(repo, port), "--gateways", "1"])
    try:
        wait_ready_for_mlp(port)
        children = psutil.Process(server.pid).children()
        redis = next(p.pid for p in children if "redis" in p.name())
        worker = next(p.pid for p in children if "redis" not in p.name())
        processes = {"gateway": server.pid, "worker": worker, "Redis": redis}
        target = f"127.0.0.1:{port if args.protocol == 'http' else port + 1}"
        csv_path = Path(tempfile.mkdtemp(prefix="budget-")) / "pa.csv"
        command = [pa[0], "-m", "mlp", "-i", args.protocol, "-u", target]
        command += ["--concurrency-range", str(args.concurrency), *PA_WINDOW, "-f", str(csv_path)]
        print("$", shlex.join(command), flush=True)
        before = {name: cpu_s(pid) for name, pid in processes.items()}
        counts_before, started = stats(port), time.monotonic()
        client = subprocess.Popen(command, env=pa[1], stdout=subprocess.DEVNULL)
        client_cpu = _cpu_until_exit(client)
        elapsed_s = time.monotonic() - started
        after = {name: cpu_s(pid) for name, pid in processes.items()}
        counts = {k: v - counts_before[k] for k, v in stats(port).items()}
    finally:
        server.terminate()
        server.wait(120)
    row = next(csv.DictReader(csv_path.open()))
    n = counts["inferences"]
    batch = n / counts["executions"]
    alone = model_alone(round(batch))
    # Triton's compute_infer counts each batch's time once per request in it
    model_s = counts["compute_ns"] / 1e9 / batch
    used = {name: after[name] - before[name] for name in processes}
    used["perf_analyzer"] = client_cpu[0]
    rate = float(row["Inferences/Second"])
    print(f"\n{args.protocol}, c={args.concurrency}: {rate:,.0f} infer/s (perf_analyzer)")
    print(f"average batch {batch:.1f}; the model alone at {round(batch)}: {alone:,.0f} infer/s")
    print(f"served ÷ alone: {n / elapsed_s / alone:.2f} (over the whole run)\n")
    print("| process | CPU µs per inference | cores |")
    print("|---|---|---|")
    for name, seconds in used.items():
        print(f"| {name} | {seconds / n * 1e6:.0f} | {seconds / elapsed_s:.2f} |")
    total = sum(used.values())
    print(f"| all | {total / n * 1e6:.0f} | {total / elapsed_s:.2f} |")
    served_us, alone_us = model_s / n * 1e6, 1e6 / alone
    print(
        f"\nThe model's compute (the statistics' compute_infer, wall time) took {served_us:.0f} "
        f"µs per inference in the worker against {alone_us:.0f} alone "
        f"({served_us / alone_us:.2f} times): "
        "time its thread waited for a core or for the GIL, or ran slower beside the others."
    )
    goal = 0.8 * alone
    others_us = (total - used["worker"]) / n * 1e6
    print(
        f"At 0.8 of the model alone ({goal:,.0f} infer/s), the model's thread needs 0.80 core "
        f"and the gateway, Redis and the client, at today's {others_us:.0f} µs per inference, "
        f"{goal * others_us / 1e6:.2f} more (the worker's own Python aside), on "
        f"{psutil.cpu_count()} cores."
    )


def _cpu_until_exit(client: subprocess.Popen[bytes]) -> list[float]:
    """perf_analyzer's CPU time, sampled until it exits (a process's times vanish with it)."""
    seen = [0.0]

    def sample() -> None:
        process = psutil.Process(client.pid)
        while client.poll() is None:
            try:
                seen[0] = cpu_s(process.pid)
            except psutil.Error:
                return
            time.sleep(0.1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    client.wait(RUN_TIMEOUT_S)
    thread.join()
    return seen


def wait_ready_for_mlp(port: int) -> None:
    deadline_s = time.monotonic() + 300
    while time.monotonic() < deadline_s:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/mlp/ready", timeout=10)
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"sluice serve on {port} did not become ready")


if __name__ == "__main__":
    main()
