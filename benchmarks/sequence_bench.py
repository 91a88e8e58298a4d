"""The sequence batcher under perf_analyzer's sequence mode: sluice (one worker, two workers)
against the real tritonserver 2.51, interleaved in one run.

The model is benchmarks/sequence_models/seq_step: a python-backend sequence model (direct
strategy, max_batch_size 8, one instance, so 8 slots per instance) whose every execute sleeps
2 ms whatever its batch, then answers each request with its sequence's running sum. Each case
(protocol, concurrency) is run on sluice with one worker, on tritonserver, then on sluice with
two workers, in turn; each server is started for its run and stopped after it, so no two run
at once and no sequence of one run is left in the next. perf_analyzer:

    perf_analyzer -m seq_step -u URL -i grpc|http [--streaming] --sequence-length 20
        --sequence-length-variation 0 --sequence-id-range 1:100000 --concurrency-range C
        -p 3000 -s 20 -r 15 -f out.csv

(C concurrent sequences; every sequence exactly 20 requests long, so sequences/s is infer/s
/ 20). Each run also reads the model's statistics before and after it: their successful
requests and executions give the real requests per execution, that is the slots that held a
request per 2 ms step, out of the server's slots (8 per instance per worker). Both servers fill
an empty slot below a batch's highest ready one with a null request (READY 0); those are not
counted here.

    python benchmarks/sequence_bench.py [--concurrency 8,32] [--protocols grpc,grpc-stream,http]
        [--ref HEAD]

Servers: `sluice serve` on 8100-8102 (embedded Redis), run by this checkout's venv from sluice
as committed at `--ref` (extracted to a folder of its own, so edits made to the checkout while
the benchmark runs do not change what it measures halfway); tritonserver by
../shared/anchor/start_tritonserver.sh on 8200-8202; perf_analyzer is the anchor's
($ANCHORS/pa-venv, with $ANCHORS/palibs on LD_LIBRARY_PATH; PERF_ANALYZER and PA_LIBDIR
override them).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPO = ROOT / "benchmarks" / "sequence_models"
MODEL = "seq_step"
TRITON_START = ROOT.parent / "shared" / "anchor" / "start_tritonserver.sh"
ANCHORS = Path(os.environ.get("ANCHORS", "/tmp/anchors"))
SLUICE_PORTS = (8100, 8101, 8102)
TRITON_PORTS = (8200, 8201, 8202)
SEQUENCE_LENGTH = 20
#: slots of one instance of the model (direct strategy: its max_batch_size).
SLOTS_PER_INSTANCE = 8
PA_WINDOW = ["-p", "3000", "-s", "20", "-r", "15"]
#: the longest one perf_analyzer run may take (15 windows of 3 s, warm-up, slack).
RUN_TIMEOUT_S = 150
#: how long a server may take to become ready, and one readiness or statistics query.
READY_TIMEOUT_S = 120
QUERY_TIMEOUT_S = 5
POLL_S = 0.25
#: how long a stopped server may take to exit.
STOP_TIMEOUT_S = 30
#: protocol name -> perf_analyzer's arguments for it, and which port (0 HTTP, 1 gRPC) it uses.
PROTOCOLS = {
    "grpc": (["-i", "grpc"], 1),
    "grpc-stream": (["-i", "grpc", "--streaming"], 1),
    "http": (["-i", "http"], 0),
}


@dataclass(frozen=True)
class Server:
    label: str
    kind: str  # "sluice" or "triton"
    workers: int
    ports: tuple[int, int, int]

    @property
    def slots(self) -> int:
        return SLOTS_PER_INSTANCE * self.workers


SERVERS = (
    Server("sluice-1w", "sluice", 1, SLUICE_PORTS),
    Server("triton", "triton", 1, TRITON_PORTS),
    Server("sluice-2w", "sluice", 2, SLUICE_PORTS),
)


def perf_analyzer() -> tuple[str, dict[str, str]]:
    binary = os.environ.get("PERF_ANALYZER") or str(ANCHORS / "pa-venv" / "bin" / "perf_analyzer")
    if not Path(binary).exists():
        raise SystemExit(f"perf_analyzer not found at {binary}: bash ../shared/anchor/setup.sh")
    libs = os.environ.get("PA_LIBDIR", str(ANCHORS / "palibs"))
    return binary, {**os.environ, "LD_LIBRARY_PATH": libs}


def frozen_tree(ref: str) -> tuple[Path, str]:
    """sluice as committed at `ref`, extracted to a folder of its own, laid out as the installed
    package maps it (sluice.gateway, sluice.shared, sluice.workers); and the commit."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", f"{ref}^{{commit}}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True)
    folder = Path(tempfile.mkdtemp(prefix=f"sluice-at-{commit}-"))
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    for name in ("gateway", "shared", "workers"):
        (folder / "sluice" / name).symlink_to(folder / name, target_is_directory=True)
    return folder, commit


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def stop_group(pid: int) -> None:
    """SIGTERM a server's process group (it leads its own session), then SIGKILL it if it
    lingers past STOP_TIMEOUT_S."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline_s = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline_s and not process_gone(pid):
        time.sleep(POLL_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def serving(server: Server, logs: Path, tree: Path) -> Iterator[None]:
    """The server up, with seq_step ready, for the duration of the block; sluice from `tree`
    (its folder ahead of the venv's own, which the workers it starts inherit)."""
    http, grpc, metrics = (str(p) for p in server.ports)
    log = logs / f"{server.label}.log"
    proc: subprocess.Popen[bytes] | None = None
    if server.kind == "sluice":
        command = [
            *(sys.executable, "-P", "-m", "sluice", "serve"),
            *("--model-repository", str(REPO), "--workers", str(server.workers)),
            *("--http-port", http, "--grpc-port", grpc, "--metrics-port", metrics),
            *("--bulk-workers", "0", "--log-level", "warning"),
        ]
        with log.open("ab") as out:
            proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(tree)},
            )
        pid = proc.pid
    else:
        started = subprocess.run(
            ["bash", str(TRITON_START), str(REPO), http, grpc, metrics, str(log)],
            capture_output=True,
            text=True,
            check=True,
        )
        pid = int(started.stdout.split()[-1])  # setsid: it leads its own process group
    try:
        wait_ready(server.ports[0], pid)
        yield
    finally:
        stop_group(pid)
        if proc is not None:
            proc.wait()


def wait_ready(port: int, pid: int) -> None:
    deadline_s = time.monotonic() + READY_TIMEOUT_S
    url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/ready"
    while time.monotonic() < deadline_s:
        if process_gone(pid):
            raise RuntimeError(f"the server on port {port} exited before it was ready")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(url, timeout=QUERY_TIMEOUT_S) as answer,
        ):
            if answer.status == 200:
                return
        time.sleep(POLL_S)
    raise RuntimeError(f"the server on port {port} was not ready in {READY_TIMEOUT_S} s")


def model_counts(port: int) -> tuple[int, int]:
    """The model's successful requests and executions, from its statistics."""
    url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/stats"
    with urllib.request.urlopen(url, timeout=QUERY_TIMEOUT_S) as answer:
        stats = json.load(answer)["model_stats"][0]
    return int(stats["inference_stats"]["success"]["count"]), int(stats["execution_count"])


def measure(server: Server, protocol: str, concurrency: int, pa_log: Path) -> dict:
    """One perf_analyzer run against a server that is up."""
    binary, env = perf_analyzer()
    args, port_index = PROTOCOLS[protocol]
    csv_path = Path(tempfile.mkdtemp(prefix="seqbench-")) / "pa.csv"
    command = [
        *(binary, "-m", MODEL, "-u", f"127.0.0.1:{server.ports[port_index]}", *args),
        *("--sequence-length", str(SEQUENCE_LENGTH), "--sequence-length-variation", "0"),
        *("--sequence-id-range", "1:100000", "--concurrency-range", str(concurrency)),
        *PA_WINDOW,
        *("-f", str(csv_path)),
    ]
    print("$", " ".join(command), flush=True)
    before = model_counts(server.ports[0])
    load_before = os.getloadavg()[0]
    try:
        run = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
        output, code = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as expired:
        output, code = f"timed out after {RUN_TIMEOUT_S} s: {expired.stdout or ''}", -1
    with pa_log.open("a") as log:
        log.write(f"$ {' '.join(command)}\n{output}\n")
    record: dict = {"server": server.label, "protocol": protocol, "c": concurrency}
    errors = [line.strip() for line in output.splitlines() if "error" in line.lower()]
    if code != 0 or not csv_path.exists():
        record["error"] = (errors or output.strip().splitlines()[-1:] or ["no output"])[-1]
        return record
    after = model_counts(server.ports[0])
    row = next(csv.DictReader(csv_path.open()))
    requests, executions = after[0] - before[0], after[1] - before[1]
    record.update(
        infer_s=float(row["Inferences/Second"]),
        p50_ms=int(row["p50 latency"]) / 1e3,
        p99_ms=int(row["p99 latency"]) / 1e3,
        batch=requests / executions if executions else 0.0,
        slots=server.slots,
        load=round((load_before + os.getloadavg()[0]) / 2, 1),
    )
    record["seq_s"] = record["infer_s"] / SEQUENCE_LENGTH
    if errors:
        record["warnings"] = errors
    return record


def ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or key not in a or key not in b or not b[key]:
        return "-"
    return f"{a[key] / b[key]:.2f}"


def report(records: list[dict], cases: list[tuple[str, int]]) -> str:
    found = {(r["server"], r["protocol"], r["c"]): r for r in records}
    lines = [
        "| protocol | c | server | sequences/s | infer/s | p50 ms | p99 ms "
        "| requests per step / slots | load avg |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for protocol, c in cases:
        for server in SERVERS:
            r = found.get((server.label, protocol, c))
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {protocol} | {c} | {server.label} | failed: {r['error']} |")
                continue
            lines.append(
                f"| {protocol} | {c} | {server.label} | {r['seq_s']:,.1f} | {r['infer_s']:,.0f} "
                f"| {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['batch']:.2f} / {r['slots']} "
                f"| {r['load']} |"
            )
    lines += [
        "",
        "| protocol | c | sequences/s 1w/triton | p99 1w/triton | sequences/s 2w/triton "
        "| p99 2w/triton | sequences/s 2w/1w | p99 2w/1w |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for protocol, c in cases:
        one, triton, two = (found.get((s.label, protocol, c)) for s in SERVERS)
        lines.append(
            f"| {protocol} | {c} | {ratio(one, triton, 'seq_s')} | {ratio(one, triton, 'p99_ms')} "
            f"| {ratio(two, triton, 'seq_s')} | {ratio(two, triton, 'p99_ms')} "
            f"| {ratio(two, one, 'seq_s')} | {ratio(two, one, 'p99_ms')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--concurrency", default="8,32", help="concurrent sequences, comma-separated"
    )
    parser.add_argument(
        "--protocols", default=",".join(PROTOCOLS), help="of " + ", ".join(PROTOCOLS)
    )
    parser.add_argument("--ref", default="HEAD", help="the commit of sluice to serve")
    parser.add_argument("--json", type=Path, help="also write the records here")
    args = parser.parse_args()
    protocols = args.protocols.split(",")
    if unknown := set(protocols) - set(PROTOCOLS):
        raise SystemExit(f"unknown protocols: {', '.join(sorted(unknown))}")
    cases = [(p, int(c)) for c in args.concurrency.split(",") for p in protocols]
    tree, commit = frozen_tree(args.ref)
    logs = Path(tempfile.mkdtemp(prefix="sequence-bench-"))
    print(f"sluice at {commit} ({tree}); server and perf_analyzer logs: {logs}", flush=True)
    records: list[dict] = []
    started_s = time.monotonic()
    for protocol, c in cases:
        for server in SERVERS:
            try:
                with serving(server, logs, tree):
                    record = measure(server, protocol, c, logs / "perf_analyzer.log")
            except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
                record = {"server": server.label, "protocol": protocol, "c": c, "error": str(error)}
            print(json.dumps(record), flush=True)
            records.append(record)
    print(f"\n{len(records)} runs in {time.monotonic() - started_s:.0f} s, sluice at {commit}\n")
    print(report(records, cases))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
