"""sluice against its peers on the reference MLP, side by side in one run.

sluice, PyTriton (Triton's dynamic batcher), Ray Serve (`@serve.batch`), BentoML (adaptive
batching) and LitServe (batching on) serve the same TorchScript MLP on one torch thread, each
with max batch 64 and a 1 ms window or its nearest setting. One closed-loop load generator
drives them all with the same 512 floats (KServe v2 JSON, and binary, for sluice and PyTriton;
each peer's own JSON route for the others), at each concurrency taking every server in turn.
Prints throughput, p50/p99, average batch and CPU per request of the server's process tree
and of the load generator, appends the table to benchmarks/RESULTS.md and the figures to
benchmarks/out/compare_peers.json. A peer that is not installed, or fails to start or to
answer correctly, is reported as such and the rest still run.

    python benchmarks/compare_peers.py --setup      # one venv per peer under $PEERS_HOME
    python benchmarks/compare_peers.py [--concurrency 1,8,32,64] [--seconds 5] [--peers ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
from compare_triton import EXAMPLES, ROOT, mlp_repository, record_results, server_stats  # noqa: E402
from peer_load import ERRORS, Load, Point, closed_loop, exchange, merged, tree_cpu_s  # noqa: E402
from peer_report import report  # noqa: E402
from peer_servers import (  # noqa: E402
    INSTALLS,
    SETTINGS,
    SLUICE_VARIANTS,
    Server,
    is_sluice,
    listening,
    setup,
    start,
    stop,
    venv_python,
)
from peer_servers import version as peer_version  # noqa: E402

from sluice.bench.http import encode_request  # noqa: E402
from sluice.bench.payload import InputSpec, encode_infer  # noqa: E402

PEERS = [*SLUICE_VARIANTS, *INSTALLS]
BASE_PORT = 18900
READY_TIMEOUT_S = 300
#: how often a starting server is asked again whether it answers.
READY_POLL_S = 1
TOLERANCE = 1e-4
KSERVE = {*SLUICE_VARIANTS, "pytriton"}


@dataclass(frozen=True, slots=True)
class Target:
    server: Server
    protocol: str
    request: bytes
    output: Callable[[bytes], np.ndarray]

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.server.port


def _kserve_json_output(body: bytes) -> np.ndarray:
    return np.asarray(orjson.loads(body)["outputs"][0]["data"], np.float32)


def _kserve_binary_output(body: bytes) -> np.ndarray:
    """The raw tensor after the JSON header (latin-1 keeps one character per byte)."""
    _, end = json.JSONDecoder().raw_decode(body.decode("latin-1"))
    return np.frombuffer(body[end:], np.float32)


def _peer_json_output(body: bytes) -> np.ndarray:
    return np.asarray(orjson.loads(body), np.float32).reshape(-1)


def targets_of(server: Server, row: np.ndarray) -> list[Target]:
    """The requests a server takes: the same row of floats in each."""
    authority = f"127.0.0.1:{server.port}"
    if server.peer in KSERVE:
        spec = [InputSpec("INPUT__0", "FP32", row.shape)]
        return [
            Target(
                server,
                "binary" if binary else "json",
                encode_infer(authority, "mlp", spec, [row], binary=binary),
                _kserve_binary_output if binary else _kserve_json_output,
            )
            for binary in (False, True)
        ]
    body = orjson.dumps({"data": row.tolist()})
    headers = {"Content-Type": "application/json"}
    request = encode_request("POST", authority, "/predict", body, headers)
    return [Target(server, "json", request, _peer_json_output)]


def check_answers(targets: list[Target], expected: np.ndarray) -> None:
    """Wait until the server answers, then check every protocol's answer against the model."""
    server, deadline_s = targets[0].server, time.monotonic() + READY_TIMEOUT_S
    last = "no answer"
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"exited ({server.process.returncode}): {server.tail()}")
        try:
            status, body = exchange(targets[0].address, targets[0].request)
            if status == 200:
                break
            last = f"HTTP {status}: {body[:300]!r}"
            if status == 422:  # a route that can never take this body
                raise RuntimeError(last)
        except (OSError, *ERRORS) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"not answering after {READY_TIMEOUT_S} s ({last}): {server.tail()}")
        time.sleep(READY_POLL_S)
    for target in targets:
        status, body = exchange(target.address, target.request)
        if status != 200:
            raise RuntimeError(f"{target.protocol}: HTTP {status}: {body[:200]!r}")
        got = target.output(body)
        if got.shape != expected.shape or not np.allclose(got, expected, atol=TOLERANCE):
            raise RuntimeError(f"{target.protocol}: answer differs from the model's")


def executed(server: Server) -> tuple[int, int]:
    """(executions, inferences) so far: sluice's statistics, the peers' counters."""
    if is_sluice(server.peer):
        inferences, executions, _ = server_stats(f"127.0.0.1:{server.port}")
        return executions, inferences
    return server.batches()


@dataclass(slots=True)
class Turns:
    """One server and protocol at one concurrency: its turns so far, merged at the end."""

    target: Target
    concurrency: int
    points: list[Point] = field(default_factory=list)
    runs: int = 0
    inferences: int = 0
    error: str | None = None

    def take(self, warmup_s: float, measure_s: float) -> None:
        """One more turn: a closed loop warmed up, then measured for `measure_s`."""
        if self.error is not None:
            return
        server = self.target.server
        load = Load(
            self.target.address,
            self.target.request,
            self.concurrency,
            warmup_s,
            measure_s,
            server.pid,
        )
        try:
            before = executed(server)
            self.points.append(closed_loop(load))
            after = executed(server)
        except (OSError, *ERRORS) as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self.runs += after[0] - before[0]
        self.inferences += after[1] - before[1]

    def row(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "peer": self.target.server.peer,
            "protocol": self.target.protocol,
            "concurrency": self.concurrency,
        }
        if self.error is not None or not self.points:
            row["error"] = self.error or "no turn measured"
            print(f"c={self.concurrency:3d} {row['peer']:9s} {row['protocol']:6s} {row['error']}")
            return row
        point = merged(self.points)
        row.update(
            throughput=point.throughput,
            p50_ms=point.percentile_ms(0.50),
            p99_ms=point.percentile_ms(0.99),
            avg_batch=self.inferences / self.runs if self.runs else None,
            server_cpu_ms=point.cpu_ms_per_request(point.server_cpu_s),
            loadgen_cpu_ms=point.cpu_ms_per_request(point.loadgen_cpu_s),
            machine_busy=point.machine_busy,
            errors=point.errors,
            turns=len(self.points),
        )
        print(
            f"c={self.concurrency:3d} {row['peer']:9s} {row['protocol']:6s} "
            f"{row['throughput']:8.1f}/s p50 {row['p50_ms']:7.2f} p99 {row['p99_ms']:7.2f} ms "
            f"batch {row['avg_batch'] or 0:5.1f} server {row['server_cpu_ms']:.2f} "
            f"loadgen {row['loadgen_cpu_ms']:.2f} ms/req errors {sum(point.errors.values())}",
            flush=True,
        )
        return row


def sweep(
    targets: list[Target], levels: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """At each concurrency, every target in turn, `rounds` times (the order rotated each round)."""
    rows = []
    for c in levels:
        turns = [Turns(target, c) for target in targets]
        for r in range(args.rounds):
            first = r % max(1, len(turns))
            for turn in turns[first:] + turns[:first]:
                turn.take(args.warmup_s, args.measure_s / args.rounds)
        rows += [turn.row() for turn in turns]
    return rows


def idle_cores(servers: dict[str, Server], window_s: float = 3.0) -> dict[str, float]:
    """What each server's process tree burns with no load, in cores."""
    before = {peer: tree_cpu_s(s.pid) for peer, s in servers.items()}
    time.sleep(window_s)
    return {
        peer: round((tree_cpu_s(s.pid) - before[peer]) / window_s, 3) for peer, s in servers.items()
    }


def listens(server: Server) -> str:
    """Where the server's process tree listens: loopback only, or what else."""
    found = listening(server.pid)
    off = sorted(f"{ip}:{port}" for ip, port in found if not ip.is_loopback)
    if off:
        return f"{len(found)} TCP ports, NOT only loopback: " + ", ".join(off)
    return f"{len(found)} TCP ports, all on loopback"


def start_all(
    peers: list[str], repo: Path, row: np.ndarray, expected: np.ndarray
) -> tuple[dict[str, Server], list[Target], dict[str, str]]:
    model = repo / "mlp" / "1" / "model.pt"
    failed: dict[str, str] = {}
    servers: dict[str, Server] = {}
    for i, peer in enumerate(peers):
        if not is_sluice(peer) and not venv_python(peer).exists():
            failed[peer] = "not installed (run with --setup)"
            continue
        servers[peer] = start(peer, BASE_PORT + 10 * i, model, repo)
    targets: list[Target] = []
    try:
        for peer, server in list(servers.items()):
            mine = targets_of(server, row)
            try:
                check_answers(mine, expected)
            except (RuntimeError, OSError, *ERRORS) as exc:
                failed[peer] = f"{type(exc).__name__}: {exc}".replace("\n", " / ")[:600]
                print(f"{peer}: {failed[peer]}", flush=True)
                stop(servers.pop(peer))
                continue
            print(f"{peer}: ready, answers match the model", flush=True)
            targets += mine
    except BaseException:
        for server in servers.values():
            stop(server)
        raise
    return servers, targets, failed


def reference(repo: Path, row: np.ndarray) -> np.ndarray:
    torch.set_num_threads(1)
    model = torch.jit.load(str(repo / "mlp" / "1" / "model.pt")).eval()
    with torch.inference_mode():
        result: np.ndarray = model(torch.from_numpy(row)).numpy().reshape(-1)
    return result


def commit() -> str:
    """HEAD, and the files of sluice's own code that differ from it (the tree is what ran)."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    changed = subprocess.run(
        [*git, "status", "--porcelain", "-uno", "--", "sluice", "gateway", "workers", "shared"],
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    paths = [line[3:] for line in changed if line.strip()]
    if not paths:
        return head.stdout.strip()
    return f"{head.stdout.strip()} with uncommitted changes to " + ", ".join(paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setup", action="store_true", help="install the peers, then stop")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument(
        "--seconds", dest="measure_s", type=float, default=5.0, help="measured per point, in all"
    )
    parser.add_argument("--rounds", type=int, default=5, help="turns each point's time is cut in")
    parser.add_argument(
        "--warmup", dest="warmup_s", type=float, default=0.5, help="before each turn"
    )
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = parser.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    if args.setup:
        setup([p for p in peers if not is_sluice(p)])
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    if not (EXAMPLES / "mlp" / "1" / "model.pt").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "build_models.py")], check=True)
    repo = mlp_repository(lambda config: config)
    row = np.random.default_rng(0).random((1, 512)).astype(np.float32)
    load_before, revision = os.getloadavg(), commit()
    servers, targets, failed = start_all(peers, repo, row, reference(repo, row))
    rows: list[dict[str, Any]] = []
    idle: dict[str, float] = {}
    sockets: dict[str, str] = {}
    try:
        sockets = {peer: listens(server) for peer, server in servers.items()}
        idle = idle_cores(servers)
        rows = sweep(targets, levels, args)
    finally:
        for server in servers.values():
            stop(server)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python benchmarks/compare_peers.py", *sys.argv[1:]]),
        "commit": revision,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_before": " ".join(f"{v:.2f}" for v in load_before),
        "load_after": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "loadgen": "a raw keep-alive HTTP/1.1 client on uvloop, one process",
        "warmup_s": args.warmup_s,
        "seconds": args.measure_s,
        "rounds": args.rounds,
        "servers": {
            peer: {
                "version": peer_version(peer),
                "settings": SETTINGS[peer],
                "idle_cores": idle.get(peer, "-"),
                "listens": sockets.get(peer, "-"),
            }
            for peer in servers
        },
        "failed": failed,
    }
    text = report(meta, rows)
    print(text)
    record_results(args.results, text, "compare_peers", {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
