"""A lone request's latency, and where it goes between the processes that carry it.

The identity model of benchmarks/gateway_processes.py (TorchScript, FP32[512], max batch 64,
`max_queue_delay_microseconds: 0`) makes sluice's own overhead the whole latency. perf_analyzer
(sync, concurrency 1) measures p50 over HTTP and gRPC against `sluice serve` (embedded Redis,
one worker, one gateway), in turn. The server's statistics give each request's queue and compute
time.

With `--timeline`, tcpdump records loopback while perf_analyzer runs over HTTP, and each
request's packets are put in order: client → gateway → Redis → worker → Redis → gateway →
client. The kernel's timestamp on each packet gives the time between the hops with nothing
added to the processes; the table shows the median of each hop over the requests whose packets
came in the usual order.

    python benchmarks/lone_request.py [--rounds 2] [--timeline]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_triton import perf_analyzer
from gateway_processes import MODEL, build_repository, wait_ready_for
from shared_memory_bench import RUN_TIMEOUT_S, free_ports, serve_command

PA_LONE = ["-p", "3000", "-s", "50", "-r", "5", "--percentile", "50"]
TIMELINE_S = 3


def measure(protocol: str, port: int) -> dict[str, float]:
    """p50 at concurrency 1, and the server's queue and compute time per request (µs)."""
    pa = perf_analyzer()
    if pa is None:
        raise SystemExit("perf_analyzer not found: set PERF_ANALYZER and PA_LIBDIR")
    url = f"127.0.0.1:{port if protocol == 'http' else port + 1}"
    csv_path = Path(tempfile.mkdtemp(prefix="lone-pa-")) / "out.csv"
    command = [pa[0], "-m", MODEL, "-i", protocol, "-u", url, "--concurrency-range", "1"]
    command += [*PA_LONE, "-f", str(csv_path)]
    before = model_stats(port)
    print("$", shlex.join(command), flush=True)
    run = subprocess.run(command, env=pa[1], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if run.returncode != 0 or not csv_path.exists():
        raise SystemExit((run.stdout + run.stderr)[-2000:])
    after = model_stats(port)
    row = next(csv.DictReader(csv_path.open()))
    count = after["count"] - before["count"]
    return {
        "p50_ms": int(row["p50 latency"]) / 1e3,
        "queue_us": (after["queue_ns"] - before["queue_ns"]) / count / 1e3,
        "compute_us": (after["compute_ns"] - before["compute_ns"]) / count / 1e3,
    }


def model_stats(port: int) -> dict[str, int]:
    url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/stats"
    with urllib.request.urlopen(url, timeout=10) as response:
        stats = json.load(response)["model_stats"][0]["inference_stats"]
    compute = ("compute_input", "compute_infer", "compute_output")
    return {
        "count": stats["success"]["count"],
        "queue_ns": stats["queue"]["ns"],
        "compute_ns": sum(stats[part]["ns"] for part in compute),
    }


def start_sluice(repo: Path, redis_port: int | None) -> tuple[subprocess.Popen[bytes], int]:
    """`sluice serve` on its embedded Redis (a Unix socket), or on Redis at `redis_port`."""
    port = free_ports(18500)
    command = [*serve_command(repo, port), "--gateways", "1"]
    if redis_port is not None:
        command += ["--redis-url", f"redis://127.0.0.1:{redis_port}"]
    server = subprocess.Popen(command)
    wait_ready_for(port)
    return server, port


def start_tcp_redis() -> tuple[subprocess.Popen[bytes], int]:
    """A Redis on loopback TCP, whose traffic tcpdump sees (a Unix socket's it does not)."""
    port = free_ports(18700)
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(100):
        if subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout:
            return server, port
        time.sleep(0.1)
    raise SystemExit("redis-server did not start")


def roles(server_pid: int, http_port: int, redis_port: int) -> dict[int, str]:
    """Each loopback port of the server's processes, named by who owns it."""
    owner: dict[int, str] = {http_port: "gateway", redis_port: "redis"}
    root = psutil.Process(server_pid)
    for process in [root, *root.children(recursive=True)]:
        name = "redis" if "redis" in process.name() else "worker"
        if process.pid == server_pid:
            name = "gateway"
        for connection in process.net_connections("tcp"):
            if connection.laddr:
                owner.setdefault(connection.laddr.port, name)
    return owner


PACKET = re.compile(r"^(\d+\.\d+) IP [\d.]+\.(\d+) > [\d.]+\.(\d+): tcp (\d+)")


def timeline(repo: Path) -> None:
    """Record loopback during a c=1 HTTP run on a TCP Redis and print each hop's median."""
    tcpdump = shutil.which("tcpdump")
    if tcpdump is None:
        raise SystemExit("tcpdump not found (apt-get install tcpdump)")
    redis_server, redis_port = start_tcp_redis()
    server, port = start_sluice(repo, redis_port)
    try:
        record(tcpdump, lambda: roles(server.pid, port, redis_port), port)
    finally:
        server.terminate()
        server.wait(120)
        redis_server.terminate()
        redis_server.wait(30)


def record(tcpdump: str, owners: Callable[[], dict[int, str]], port: int) -> None:
    capture = Path(tempfile.mkdtemp(prefix="lone-cap-")) / "lo.pcap"
    recorder = subprocess.Popen(
        [tcpdump, "-i", "lo", "-n", "-q", "-B", "65536", "-w", str(capture), "tcp"],
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1)
    pa = perf_analyzer()
    assert pa is not None
    command = [pa[0], "-m", MODEL, "-i", "http", "-u", f"127.0.0.1:{port}"]
    command += ["--concurrency-range", "1", "-p", str(TIMELINE_S * 1000), "-s", "50", "-r", "3"]
    subprocess.run(command, env=pa[1], capture_output=True, timeout=RUN_TIMEOUT_S)
    owner = owners()  # after the run: connections opened on the way are known too
    recorder.send_signal(signal.SIGINT)
    recorder.wait(30)
    text = subprocess.run(
        [tcpdump, "-r", str(capture), "-n", "-tt", "-q"], capture_output=True, text=True
    ).stdout
    packets = []
    for line in text.splitlines():
        match = PACKET.match(line)
        if match is None or int(match[4]) == 0:
            continue
        source = owner.get(int(match[2]), "client")
        destination = owner.get(int(match[3]), "client")
        packets.append((float(match[1]), source, destination))
    report_hops(packets)


def report_hops(packets: list[tuple[float, str, str]]) -> None:
    """Split the packets into requests (each starts client → gateway) and report the most
    common order of hops, with each hop's median time since the previous one."""
    requests: list[list[tuple[float, str]]] = []
    for stamp, source, destination in packets:
        hop = f"{source}→{destination}"
        if hop == "client→gateway" and (not requests or requests[-1][-1][1] != hop):
            requests.append([(stamp, hop)])
        elif requests:
            current = requests[-1]
            if current[-1][1] != hop:  # a message in several packets counts once
                current.append((stamp, hop))
    signatures = Counter(tuple(hop for _, hop in request) for request in requests)
    if not signatures:
        print("no requests seen on loopback")
        return
    usual, seen = signatures.most_common(1)[0]
    print(f"\n{seen} of {len(requests)} requests in the usual order of hops\n")
    rows = [r for r in requests if tuple(hop for _, hop in r) == usual]
    print("| hop | µs since the previous hop, median | since the request |")
    print("|---|---|---|")
    for k, hop in enumerate(usual):
        gap = statistics.median(r[k][0] - r[k - 1][0] for r in rows) * 1e6 if k else 0.0
        since = statistics.median(r[k][0] - r[0][0] for r in rows) * 1e6
        print(f"| {hop} | {gap:.0f} | {since:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeline", action="store_true", help="hops from a loopback capture")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = build_repository(Path(tmp))
        for round_ in range(args.rounds):
            server, port = start_sluice(repo, None)
            try:
                for protocol in ("http", "grpc") if round_ % 2 == 0 else ("grpc", "http"):
                    figures = measure(protocol, port)
                    results.setdefault(protocol, []).append(figures)
                    print(protocol, figures, flush=True)
            finally:
                server.terminate()
                server.wait(120)
        if args.timeline:
            timeline(repo)
    print(f"\nperf_analyzer sync, c=1, medians of {args.rounds} rounds\n")
    print("| protocol | p50 ms | queue µs | compute µs |")
    print("|---|---|---|---|")
    for protocol, rows in results.items():
        p50, queue, compute = (
            statistics.median(r[key] for r in rows) for key in ("p50_ms", "queue_us", "compute_us")
        )
        print(f"| {protocol} | {p50:.3f} | {queue:.0f} | {compute:.0f} |")


if __name__ == "__main__":
    main()
