"""The gateway's gRPC API against its HTTP API, side by side on one `sluice serve`.

One `sluice serve` (embedded Redis, one worker) on examples/model_repository's `mlp`, driven by
Triton's perf_analyzer (sync, batch 1) with `-i http` and `-i grpc` in turn at c=1 and c=64;
the order of the two protocols alternates from round to round, so a slow spell of a shared
machine does not land on one of them. The table gives each figure's median over the rounds,
and the gateway's CPU time per inference (serve's own process: the gateway; the worker runs in
a child process).

    python benchmarks/grpc_vs_http.py [--rounds 3] [--baseline REF] [--grpcio]

`--baseline REF` also serves gRPC from a second `sluice serve` whose gateway/grpc_*.py are as
they are at git REF (the rest of the tree is this checkout's), measured in the same rounds
(row `grpc@REF`): a change to the gRPC transport against what it replaced, side by side.
`--grpcio` does the same with a second `sluice serve --grpc-server grpcio` (row
`grpc (grpcio)`): grpcio's asyncio server against the gateway's own HTTP/2.

perf_analyzer as benchmarks/compare_triton.py finds it (PERF_ANALYZER and PA_LIBDIR, or the
Triton anchor's under $ANCHORS); this one needs it (`sluice bench` speaks HTTP only).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from compare_triton import EXAMPLES, perf_analyzer, server_stats, wait_ready  # noqa: E402
from http_servers import cpu_time_s, running  # noqa: E402

PROTOCOLS = ("http", "grpc")
LEVELS = (1, 64)
#: a 3 s window, stable within 50 % over up to 8 windows: a shared 2-core machine rarely
#: settles within perf_analyzer's default 10 %.
#: the longest one perf_analyzer run may take.
RUN_TIMEOUT_S = 600
PA_WINDOW = ["-p", "3000", "-s", "50", "-r", "8"]


#: `sluice serve` with the modules of a folder (argv[1]) found first in sluice.gateway.
OVERLAY_LAUNCHER = (
    "import sys, sluice.gateway as g; g.__path__.insert(0, sys.argv.pop(1)); "
    "from sluice.cli import main; main()"
)


def grpc_modules_at(ref: str) -> Path:
    """gateway/grpc_*.py as they are at git `ref`, in a folder of their own."""
    folder = Path(tempfile.mkdtemp(prefix="grpc-at-"))

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout

    for path in git("ls-tree", "--name-only", ref, "gateway/").split():
        name = Path(path).name
        if name.startswith("grpc_") and name.endswith(".py"):
            (folder / name).write_text(git("show", f"{ref}:{path}"))
    return folder


def serve_command(port: int, overlay: Path | None = None, *extra: str) -> list[str]:
    """HTTP on `port`, gRPC on `port + 1`, metrics on `port + 2`, as Triton's 8000-8002;
    with `overlay`, the gateway modules found there replace this checkout's."""
    python = (sys.executable, "-m", "sluice")
    if overlay is not None:
        python = (sys.executable, "-c", OVERLAY_LAUNCHER, str(overlay))
    return [
        *(*python, "serve", "--model-repository", str(EXAMPLES)),
        *("--http-port", str(port), "--grpc-port", str(port + 1)),
        *("--metrics-port", str(port + 2), "--bulk-workers", "0", "--log-level", "warning"),
        *extra,
    ]


def measure(protocol: str, port: int, level: int, pid: int) -> dict[str, float | str]:
    """perf_analyzer's figures for one protocol at one level, and the gateway's CPU time per
    inference over the whole run (server statistics give the inference count)."""
    pa = perf_analyzer()
    if pa is None:
        raise SystemExit("perf_analyzer not found: set PERF_ANALYZER and PA_LIBDIR")
    http_url = f"127.0.0.1:{port}"
    url = http_url if protocol == "http" else f"127.0.0.1:{port + 1}"
    csv_path = Path(tempfile.mkdtemp()) / "pa.csv"
    command = [pa[0], "-m", "mlp", "-i", protocol, "-u", url, "--concurrency-range", str(level)]
    inferences, cpu_s = server_stats(http_url)[0], cpu_time_s(pid)
    run = subprocess.run(
        [*command, *PA_WINDOW, "-f", str(csv_path)],
        env=pa[1],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    if run.returncode != 0 or not csv_path.exists():
        return {"error": " ".join(run.stdout.strip().splitlines()[-1:])}
    inferences = server_stats(http_url)[0] - inferences
    row = next(csv.DictReader(csv_path.open()))
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50_ms": int(row["p50 latency"]) / 1e3,
        "p99_ms": int(row["p99 latency"]) / 1e3,
        "gateway_cpu_us": (cpu_time_s(pid) - cpu_s) * 1e6 / max(1, inferences),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def report(
    runs: dict[tuple[str, int], list[dict[str, float | str]]], labels: list[str], rounds: int
) -> str:
    lines = [
        f"medians of {rounds} round(s); perf_analyzer sync, batch 1, mlp",
        "| protocol | c | infer/s | p50 ms | p99 ms | gateway CPU µs/infer | load avg |",
        "|---|---|---|---|---|---|---|",
    ]
    for level in LEVELS:
        for label in labels:
            ok = [r for r in runs[(label, level)] if "error" not in r]
            if not ok:
                errors = {str(r["error"]) for r in runs[(label, level)]}
                lines.append(f"| {label} | {level} | failed: {'; '.join(errors)} |")
                continue

            def median(key: str, rows: list[dict[str, float | str]] = ok) -> float:
                return statistics.median(float(r[key]) for r in rows)

            lines.append(
                f"| {label} | {level} | {median('throughput'):,.0f} | "
                f"{median('p50_ms'):.2f} | {median('p99_ms'):.2f} | "
                f"{median('gateway_cpu_us'):.0f} | {median('loadavg_1m'):.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=18800)
    parser.add_argument("--baseline", metavar="REF", help="also gRPC with grpc_*.py at REF")
    parser.add_argument("--grpcio", action="store_true", help="also gRPC on grpcio's server")
    args = parser.parse_args()
    if not (EXAMPLES / "mlp" / "1" / "model.pt").exists():
        raise SystemExit("build the example models first: python examples/build_models.py")
    with contextlib.ExitStack() as stack:
        serve = stack.enter_context(running(serve_command(args.port)))
        # label -> (protocol, the serve's HTTP port, its pid)
        targets = {p: (p, args.port, serve.pid) for p in PROTOCOLS}
        if args.baseline:
            port = args.port + 10
            overlay = grpc_modules_at(args.baseline)
            other = stack.enter_context(running(serve_command(port, overlay)))
            targets[f"grpc@{args.baseline}"] = ("grpc", port, other.pid)
        if args.grpcio:
            port = args.port + 20
            other = stack.enter_context(
                running(serve_command(port, None, "--grpc-server", "grpcio"))
            )
            targets["grpc (grpcio)"] = ("grpc", port, other.pid)
        for _, port, _ in targets.values():
            wait_ready(f"127.0.0.1:{port}")
        labels = list(targets)
        runs: dict[tuple[str, int], list[dict[str, float | str]]] = {
            (label, c): [] for label in labels for c in LEVELS
        }
        for n in range(args.rounds):
            for level in LEVELS:
                for label in labels if n % 2 == 0 else labels[::-1]:
                    protocol, port, pid = targets[label]
                    row = measure(protocol, port, level, pid)
                    print(label, level, row, flush=True)
                    runs[(label, level)].append(row)
    print(report(runs, labels, args.rounds))


if __name__ == "__main__":
    main()
