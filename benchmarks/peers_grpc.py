"""sluice against the peers that speak gRPC, on the reference MLP, side by side in one run.

PyTriton (Triton's own gRPC frontend and dynamic batcher) and Ray Serve (its gRPC proxy with
KServe's servicer: benchmarks/peers/serve_ray.py) serve the same TorchScript MLP as sluice,
max batch 64 and a 1 ms window, on one torch thread. BentoML 1.4 and LitServe serve no gRPC.
perf_analyzer (sync, `-i grpc`, the same request for all) drives each server in turn at each
concurrency, the order rotated each round; the answers are first checked against the model.
Prints throughput, p50, p99, average batch and the server's CPU per inference (its process
tree), and sluice's ratio to each peer.

    python benchmarks/compare_peers.py --setup --peers pytriton,ray   # the peers' venvs
    python benchmarks/peers_grpc.py [--concurrency 1,8,64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from compare_peers import executed, reference  # noqa: E402
from compare_triton import EXAMPLES, mlp_repository, perf_analyzer  # noqa: E402
from peer_load import tree_cpu_s  # noqa: E402
from peer_servers import Server, is_sluice, start, stop, venv_python  # noqa: E402
from tritonclient.grpc import service_pb2 as pb  # noqa: E402

PEERS = ["sluice", "pytriton", "ray"]
BASE_PORT = 19300
READY_TIMEOUT_S = 300
READY_POLL_S = 1.0
RUN_TIMEOUT_S = 300
PA_WINDOW = ["-p", "3000", "-s", "50", "-r", "5"]
METHOD = "/inference.GRPCInferenceService/ModelInfer"
TOLERANCE = 1e-4


def answers_match(server: Server, row: np.ndarray, expected: np.ndarray) -> None:
    """Wait until the server answers ModelInfer on its gRPC port, and check the answer."""
    request = pb.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="INPUT__0", datatype="FP32", shape=list(row.shape))
    request.raw_input_contents.append(row.tobytes())
    deadline_s, last = time.monotonic() + READY_TIMEOUT_S, "no answer"
    with grpc.insecure_channel(f"127.0.0.1:{server.port + 1}") as channel:
        call = channel.unary_unary(
            METHOD, pb.ModelInferRequest.SerializeToString, pb.ModelInferResponse.FromString
        )
        while time.monotonic() < deadline_s:
            if server.process.poll() is not None:
                raise RuntimeError(f"exited ({server.process.returncode}): {server.tail()}")
            try:
                response = call(request, timeout=10)
            except grpc.RpcError as exc:
                last = f"{exc.code()}: {exc.details()}"
                time.sleep(READY_POLL_S)
                continue
            got = np.frombuffer(response.raw_output_contents[0], np.float32)
            if not np.allclose(got, expected, atol=TOLERANCE):
                raise RuntimeError("answer differs from the model's")
            return
    raise RuntimeError(f"not answering after {READY_TIMEOUT_S} s ({last}): {server.tail()}")


def measure(server: Server, concurrency: int) -> dict[str, Any]:
    pa = perf_analyzer()
    if pa is None:
        raise SystemExit("perf_analyzer not found: set PERF_ANALYZER and PA_LIBDIR")
    csv_path = Path(tempfile.mkdtemp(prefix="peers-grpc-")) / "pa.csv"
    command = [pa[0], "-m", "mlp", "-i", "grpc", "-u", f"127.0.0.1:{server.port + 1}"]
    command += ["--concurrency-range", str(concurrency), *PA_WINDOW, "-f", str(csv_path)]
    before, cpu_before = executed(server), tree_cpu_s(server.pid)
    run = subprocess.run(command, env=pa[1], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    after, cpu_after = executed(server), tree_cpu_s(server.pid)
    if run.returncode != 0 or not csv_path.exists():
        return {"error": " / ".join((run.stdout + run.stderr).strip().splitlines()[-2:])}
    row = next(csv.DictReader(csv_path.open()))
    executions, inferences = after[0] - before[0], after[1] - before[1]
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_ms": int(row["p50 latency"]) / 1e3,
        "p99_ms": int(row["p99 latency"]) / 1e3,
        "batch": inferences / executions if executions else 0.0,
        "cpu_us": (cpu_after - cpu_before) / inferences * 1e6 if inferences else 0.0,
    }


def report(results: dict[tuple[str, int], list[dict[str, Any]]], levels: list[int]) -> str:
    lines = [
        "| c | server | infer/s | p50 ms | p99 ms | avg batch | server CPU µs/infer | "
        "sluice ÷ it (infer/s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in levels:
        medians = {}
        for peer in PEERS:
            runs = [r for r in results.get((peer, c), []) if "error" not in r]
            if runs:
                medians[peer] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for peer in PEERS:
            if peer not in medians:
                errors = [r["error"] for r in results.get((peer, c), []) if "error" in r]
                lines.append(f"| {c} | {peer} | {errors[:1] or 'not run'} | | | | | |")
                continue
            m = medians[peer]
            ratio = ""
            if peer != "sluice" and "sluice" in medians and m["throughput"]:
                ratio = f"{medians['sluice']['throughput'] / m['throughput']:.2f}"
            lines.append(
                f"| {c} | {peer} | {m['throughput']:,.0f} | {m['p50_ms']:.2f} | "
                f"{m['p99_ms']:.2f} | {m['batch']:.1f} | {m['cpu_us']:.0f} | {ratio} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peers", default=",".join(PEERS))
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    peers = [p for p in args.peers.split(",") if p in PEERS]
    repo = mlp_repository(lambda config: config)
    row = np.random.default_rng(0).random((1, 512)).astype(np.float32)
    expected = reference(repo, row)
    model = EXAMPLES / "mlp" / "1" / "model.pt"
    servers: dict[str, Server] = {}
    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    try:
        for i, peer in enumerate(peers):
            if not is_sluice(peer) and not venv_python(peer).exists():
                print(f"{peer}: not installed (compare_peers.py --setup --peers {peer})")
                continue
            server = start(peer, BASE_PORT + 10 * i, model, repo)
            try:
                answers_match(server, row, expected)
            except RuntimeError as exc:
                print(f"{peer}: {exc}", flush=True)
                stop(server)
                continue
            servers[peer] = server
            print(f"{peer}: ready over gRPC, answers match the model", flush=True)
        order = list(servers)
        for c in levels:
            for r in range(args.rounds):
                first = r % max(1, len(order))
                for peer in order[first:] + order[:first]:
                    figures = measure(servers[peer], c)
                    results.setdefault((peer, c), []).append(figures)
                    print(f"c={c} {peer}: {figures}", flush=True)
    finally:
        for server in servers.values():
            stop(server)
    print(f"\nperf_analyzer sync over gRPC, medians of {args.rounds} rounds\n")
    print(report(results, levels))


if __name__ == "__main__":
    main()
