"""What Triton's system shared memory saves the gateway: perf_analyzer with and without it.

A client that registers POSIX shared-memory regions sends no tensor bytes in its requests and
gets none back: the gateway reads the inputs from the region and writes the outputs into it.
This measures what that is worth on one host, where the client and the gateway share it: one
`sluice serve` (embedded Redis, one worker) serves two TorchScript identity models built here
at run time into a temporary repository (no .pt file is kept), FP32[512] (2 KiB) and
FP32[262144] (1 MiB), max_batch_size 8, `dynamic_batching {}`: a model that costs almost
nothing, so the gateway's part dominates. Triton's perf_analyzer (sync, batch 1) drives each
model over HTTP and gRPC, each with and without `--shared-memory system
--output-shared-memory-size <bytes>`, at each concurrency; the order of the four variants
flips from cell to cell and from round to round, and a run that does not settle is run once
more. Each row gives perf_analyzer's infer/s, p50 and p99, and the gateway's CPU time (utime +
stime from /proc of the process holding the HTTP listening socket: serve's own) over the run
divided by the inferences the model's statistics counted in it, medians over the rounds; the
ratios are shared memory over the same protocol without it.

    python benchmarks/shared_memory_bench.py [--concurrency 8,1] [--rounds 2] [--port 18900]

perf_analyzer as benchmarks/compare_triton.py finds it (PERF_ANALYZER and PA_LIBDIR, or the
Triton anchor's under $ANCHORS: `bash ../shared/anchor/setup.sh`).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from compare_triton import perf_analyzer  # noqa: E402
from http_servers import cpu_time_s, running  # noqa: E402

#: model name -> FP32 elements of its one input and output (2 KiB, 1 MiB).
MODELS = {"identity_2k": 512, "identity_1m": 262144}
FP32_BYTES = 4
PROTOCOLS = ("http", "grpc")
#: perf_analyzer's window as the Triton anchor uses it on this noisy 2-core machine.
PA_WINDOW = ["-p", "3000", "-s", "20", "-r", "15"]
#: the longest one perf_analyzer run may take.
RUN_TIMEOUT_S = 600
READY_TIMEOUT_S = 180
READY_POLL_S = 0.5
HTTP_TIMEOUT_S = 10

CONFIG = """name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ {elements} ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ {elements} ] }} ]
dynamic_batching {{ }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters: {{ key: "INTRA_OP_THREAD_COUNT" value: {{ string_value: "1" }} }}
parameters: {{ key: "INTER_OP_THREAD_COUNT" value: {{ string_value: "1" }} }}
"""


def build_repository(folder: Path) -> Path:
    """A model repository with a TorchScript identity per size (torch imported here only)."""
    import torch

    class Identity(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    scripted = torch.jit.script(Identity().eval())
    for name, elements in MODELS.items():
        (folder / name / "1").mkdir(parents=True)
        (folder / name / "config.pbtxt").write_text(CONFIG.format(name=name, elements=elements))
        torch.jit.save(scripted, str(folder / name / "1" / "model.pt"))
    return folder


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(start: int) -> int:
    """The first port from `start` on (by tens) that is free with the two after it."""
    for base in range(start, start + 1000, 10):
        if all(port_free(base + k) for k in range(3)):
            return base
    raise SystemExit(f"no three free ports from {start}")


def serve_command(repository: Path, port: int) -> list[str]:
    """HTTP on `port`, gRPC on `port + 1`, metrics on `port + 2`."""
    return [
        str(ROOT / ".venv" / "bin" / "sluice"),
        *("serve", "--model-repository", str(repository)),
        *("--http-port", str(port), "--grpc-port", str(port + 1), "--metrics-port", str(port + 2)),
        *("--bulk-workers", "0", "--log-level", "warning"),
    ]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
        return json.load(response)


def wait_ready(port: int) -> None:
    deadline_s = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline_s:
        try:
            for name in MODELS:
                urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/v2/models/{name}/ready", timeout=HTTP_TIMEOUT_S
                ).close()
            return
        except OSError:
            time.sleep(READY_POLL_S)
    raise SystemExit(f"sluice serve on {port} did not become ready")


def inference_count(port: int, model: str) -> int:
    stats = get_json(f"http://127.0.0.1:{port}/v2/models/{model}/stats")
    return int(stats["model_stats"][0]["inference_count"])


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc's children lists."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").iterdir():
            children = (task / "children").read_text().split()
            todo.extend(int(child) for child in children)
    return found


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP `port` (IPv4 and IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                inodes.add(fields[9])
    return inodes


def gateway_pid(serve_pid: int, port: int) -> int:
    """The process of serve's tree that holds the gateway's HTTP listening socket."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    for pid in descendants(serve_pid):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) in wanted:
                    return pid
            except OSError:
                continue
    raise SystemExit(f"no process under {serve_pid} listens on {port}")


def cmdline(pid: int) -> str:
    return " ".join(Path(f"/proc/{pid}/cmdline").read_text().split("\0")).strip()


def measure(
    model: str, protocol: str, shm: bool, level: int, port: int, gateway: int
) -> dict[str, float | str]:
    """perf_analyzer's figures for one variant, and the gateway's CPU µs per inference."""
    pa = perf_analyzer()
    if pa is None:
        raise SystemExit("perf_analyzer not found: set PERF_ANALYZER and PA_LIBDIR")
    url = f"127.0.0.1:{port if protocol == 'http' else port + 1}"
    csv_path = Path(tempfile.mkdtemp(prefix="shm-pa-")) / "out.csv"
    command = [pa[0], "-m", model, "-i", protocol, "-u", url, "--concurrency-range", str(level)]
    if shm:
        out_bytes = MODELS[model] * FP32_BYTES
        command += ["--shared-memory", "system", "--output-shared-memory-size", str(out_bytes)]
    command += [*PA_WINDOW, "-f", str(csv_path)]
    print("$ LD_LIBRARY_PATH=" + pa[1]["LD_LIBRARY_PATH"], shlex.join(command), flush=True)
    before_n, before_s = inference_count(port, model), cpu_time_s(gateway)
    run = subprocess.run(command, env=pa[1], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    cpu_s, inferences = cpu_time_s(gateway) - before_s, inference_count(port, model) - before_n
    if run.returncode != 0 or not csv_path.exists():
        text = (run.stdout + run.stderr).strip().splitlines()
        return {"error": " / ".join(text[-3:]) or f"exit {run.returncode}"}
    row = next(csv.DictReader(csv_path.open()))
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_ms": int(row["p50 latency"]) / 1e3,
        "p99_ms": int(row["p99 latency"]) / 1e3,
        "cpu_us": cpu_s * 1e6 / max(1, inferences),
        "inferences": inferences,
        "loadavg": os.getloadavg()[0],
    }


def size_label(model: str) -> str:
    size = MODELS[model] * FP32_BYTES
    return f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"


Key = tuple[str, int, str, bool]
Row = dict[str, float | str]


def measure_once_more(
    model: str, protocol: str, shm: bool, level: int, port: int, gateway: int
) -> Row:
    """`measure`, run a second time when the first could not settle (a noisy machine)."""
    row = measure(model, protocol, shm, level, port, gateway)
    if "error" in row:
        print("  failed, once more:", row["error"], flush=True)
        row = measure(model, protocol, shm, level, port, gateway)
    return row


def median_row(rows: list[Row]) -> Row:
    """Each figure's median over the rounds that succeeded; an error when none did."""
    ok = [row for row in rows if "error" not in row]
    if not ok:
        return {"error": "; ".join(sorted({str(row["error"]) for row in rows}))}
    keys = ("throughput", "p50_ms", "p99_ms", "cpu_us", "loadavg")
    return {key: statistics.median(float(row[key]) for row in ok) for key in keys}


def report(runs: dict[Key, list[Row]], levels: list[int]) -> str:
    lines = [
        "| size | c | protocol | shm | infer/s | p50 ms | p99 ms | gateway CPU µs/infer "
        "| infer/s shm/no-shm | CPU shm/no-shm | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        for level in levels:
            for protocol in PROTOCOLS:
                base = median_row(runs[(model, level, protocol, False)])
                for shm in (False, True):
                    row = median_row(runs[(model, level, protocol, shm)])
                    head = (
                        f"| {size_label(model)} | {level} | {protocol} | {'yes' if shm else 'no'}"
                    )
                    if "error" in row:
                        lines.append(f"{head} | failed: {row['error']} | | | | | | |")
                        continue
                    ratios = "| | |"
                    if shm and "error" not in base:
                        ratios = (
                            f"| {float(row['throughput']) / float(base['throughput']):.2f} "
                            f"| {float(row['cpu_us']) / float(base['cpu_us']):.2f} |"
                        )
                    lines.append(
                        f"{head} | {float(row['throughput']):,.0f} | {float(row['p50_ms']):.2f} "
                        f"| {float(row['p99_ms']):.2f} | {float(row['cpu_us']):.0f} "
                        f"{ratios} {float(row['loadavg']):.1f} |"
                    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="8", help="comma-separated levels")
    parser.add_argument("--rounds", type=int, default=1, help="rounds; the table gives medians")
    parser.add_argument("--port", type=int, default=18900, help="first port tried")
    args = parser.parse_args()
    levels = [int(level) for level in args.concurrency.split(",")]
    variants = [(protocol, shm) for protocol in PROTOCOLS for shm in (False, True)]
    runs: dict[Key, list[Row]] = {
        (m, c, p, shm): [] for m in MODELS for c in levels for p, shm in variants
    }
    with tempfile.TemporaryDirectory(prefix="shm-models-") as folder:
        repository = build_repository(Path(folder))
        port = free_ports(args.port)
        command = serve_command(repository, port)
        print("$", shlex.join(command), flush=True)
        with running(command) as serve:
            wait_ready(port)
            gateway = gateway_pid(serve.pid, port)
            print(f"gateway pid {gateway} (serve {serve.pid}): {cmdline(gateway)}", flush=True)
            cells = [(r, m, c) for r in range(args.rounds) for m in MODELS for c in levels]
            for n, (round_, model, level) in enumerate(cells):
                # the order flips from cell to cell, and again from round to round
                flip = (n + round_) % 2 == 1
                for protocol, shm in variants[::-1] if flip else variants:
                    row = measure_once_more(model, protocol, shm, level, port, gateway)
                    print(model, level, protocol, "shm" if shm else "no-shm", row, flush=True)
                    runs[(model, level, protocol, shm)].append(row)
    print(f"medians of {args.rounds} round(s); perf_analyzer sync, batch 1")
    print(report(runs, levels))


if __name__ == "__main__":
    main()
