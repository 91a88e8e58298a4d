"""sluice against Triton's dynamic batcher on the reference MLP, side by side in one run.

Measures (a) the model alone in-process (batch 1/8/32/64, torch 1 thread), before, between
and after the servers' runs, as the machine's speed drifts (ratios use the median of those
measurements, so one slow or fast spell does not move them); (b) sluice at
each concurrency with dynamic batching and with max_batch_size 1; (c) the same load against
PyTriton (Triton's C++ dynamic batcher) when its anchor environment is installed
(`bash ../shared/anchor/setup.sh`); (d) sluice at c=1 on an identity model with the MLP's
signature, so that p50 at c=1 splits into sluice's own path and the model as it runs in
place; then prints the ratios and appends them to the dated log at the end of
benchmarks/RESULTS.md (a run becomes current when it replaces that file's current table).
Load comes from Triton's perf_analyzer when available (sync, batch 1; HTTP, or gRPC with
`--protocol grpc`), else from `sluice bench` (HTTP).

    python benchmarks/compare_triton.py [--concurrency 1,8,32,64] [--skip-triton]
        [--protocol http|grpc]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from sluice.embedded_redis import EmbeddedRedis  # noqa: E402

EXAMPLES = ROOT / "examples" / "model_repository"
ANCHOR = ROOT.parent / "shared" / "anchor"
ANCHORS = Path(os.environ.get("ANCHORS", "/tmp/anchors"))
#: how long a readiness or statistics query may take.
READY_TIMEOUT_S = 2
STATS_TIMEOUT_S = 10
#: how often a starting server is asked again whether it is ready.
READY_POLL_S = 0.5
#: the longest one load run (perf_analyzer's or sluice bench's) may take.
RUN_TIMEOUT_S = 900
#: how long a stopped serve may take to exit.
STOP_TIMEOUT_S = 60
PA_ARGS = ["-p", "3000", "-s", "20", "-r", "15"]


def model_bound(trials: int = 3, trial_s: float = 2.0) -> dict[int, float]:
    """Inferences/s of the model alone, per batch size (median of trials)."""
    torch.set_num_threads(1)
    model = torch.jit.load(str(EXAMPLES / "mlp" / "1" / "model.pt")).eval()
    out = {}
    with torch.inference_mode():
        for batch in (1, 8, 32, 64):
            x = torch.randn(batch, 512)
            for _ in range(20):
                model(x)
            rates = []
            for _ in range(trials):
                n, start_s = 0, time.perf_counter()
                while time.perf_counter() - start_s < trial_s:
                    model(x)
                    n += 1
                rates.append(n * batch / (time.perf_counter() - start_s))
            out[batch] = statistics.median(rates)
    return out


def interpolate(bound: dict[int, float], batch: float) -> float:
    sizes = sorted(bound)
    if batch <= sizes[0]:
        return bound[sizes[0]]
    for lo, hi in itertools.pairwise(sizes):
        if batch <= hi:
            return bound[lo] + (bound[hi] - bound[lo]) * (batch - lo) / (hi - lo)
    return bound[sizes[-1]]


def perf_analyzer() -> tuple[str, dict[str, str]] | None:
    binary = os.environ.get("PERF_ANALYZER") or str(ANCHORS / "pa-venv" / "bin" / "perf_analyzer")
    if not Path(binary).exists():
        return None
    env = {**os.environ, "LD_LIBRARY_PATH": os.environ.get("PA_LIBDIR", str(ANCHORS / "palibs"))}
    return binary, env


def server_stats(url: str) -> tuple[int, int, dict[int, int]]:
    with urllib.request.urlopen(f"http://{url}/v2/models/mlp/stats", timeout=STATS_TIMEOUT_S) as r:
        stats = json.load(r)["model_stats"][0]
    hist = {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}
    return stats["inference_count"], stats["execution_count"], hist


def redis_commands(client: redis.Redis | None) -> int:
    if client is None:
        return 0
    stats = client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))


def run_load(
    url: str, concurrency: int, label: str, rclient: redis.Redis | None, protocol: str = "http"
) -> dict:
    """perf_analyzer's (else `sluice bench`'s, HTTP only) figures at one level over `protocol`;
    the server's gRPC port is its HTTP port + 1 (sluice's and PyTriton's here)."""
    before = server_stats(url)
    commands_before = redis_commands(rclient)
    pa = perf_analyzer()
    record: dict = {"label": label, "concurrency": concurrency}
    if pa is not None:
        csv_path = Path(tempfile.mkdtemp()) / "pa.csv"
        host, port = url.rsplit(":", 1)
        target = url if protocol == "http" else f"{host}:{int(port) + 1}"
        cmd = [
            pa[0],
            "-m",
            "mlp",
            "-i",
            protocol,
            "-u",
            target,
            "--concurrency-range",
            str(concurrency),
            *PA_ARGS,
            "-f",
            str(csv_path),
        ]
        proc = subprocess.run(cmd, env=pa[1], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if proc.returncode != 0 or not csv_path.exists():
            record["error"] = proc.stdout.strip().splitlines()[-1:]
            return record
        row = next(csv.DictReader(csv_path.open()))
        record.update(
            throughput=float(row["Inferences/Second"]),
            p50_ms=int(row["p50 latency"]) / 1e3,
            p99_ms=int(row["p99 latency"]) / 1e3,
            queue_ms=int(row["Server Queue"]) / 1e3,
            compute_ms=int(row["Server Compute Infer"]) / 1e3,
            tool="perf_analyzer",
        )
    else:
        out = Path(tempfile.mkdtemp()) / "bench.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "sluice",
                "bench",
                "--url",
                url,
                "--model",
                "mlp",
                "--concurrency",
                str(concurrency),
                "--json-out",
                str(out),
            ],
            check=True,
            capture_output=True,
            timeout=RUN_TIMEOUT_S,
        )
        result = json.loads(out.read_text())["levels"][0]["result"]
        latency = result["latency"]
        if latency is None:
            record["error"] = result["error_kinds"] or "no request succeeded"
            return record
        record.update(
            throughput=result["throughput"],
            p50_ms=latency["p50_us"] / 1e3,
            p99_ms=latency["p99_us"] / 1e3,
            tool="sluice bench",
        )
        if result["server"] is not None:
            server = result["server"]
            record.update(
                queue_ms=server["queue_us"] / 1e3, compute_ms=server["compute_infer_us"] / 1e3
            )
    after = server_stats(url)
    inferences, executions = after[0] - before[0], after[1] - before[1]
    record["avg_batch"] = round(inferences / max(1, executions), 2)
    if rclient is not None:
        record["redis_cmds_per_inference"] = round(
            (redis_commands(rclient) - commands_before) / max(1, inferences), 3
        )
    print(
        f"[{label}] c={concurrency:3d} {record.get('throughput', 0):8.1f}/s "
        f"p50 {record.get('p50_ms', 0):6.2f} ms p99 {record.get('p99_ms', 0):6.2f} ms "
        f"batch {record['avg_batch']}",
        flush=True,
    )
    return record


def mlp_repository(edit: Callable[[str], str]) -> Path:
    """A copy of the example MLP whose config.pbtxt is `edit(config)`."""
    repo = Path(tempfile.mkdtemp()) / "models"
    (repo / "mlp" / "1").mkdir(parents=True)
    shutil.copy(EXAMPLES / "mlp" / "1" / "model.pt", repo / "mlp" / "1" / "model.pt")
    (repo / "mlp" / "config.pbtxt").write_text(
        edit((EXAMPLES / "mlp" / "config.pbtxt").read_text())
    )
    return repo


def mbs1_repository() -> Path:
    return mlp_repository(lambda config: config.replace("max_batch_size: 64", "max_batch_size: 1"))


class _Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def identity_repository() -> Path:
    """The MLP's config and signature with a model that does no work: sluice's own path."""
    repo = mlp_repository(lambda config: config)
    torch.jit.script(_Identity()).save(str(repo / "mlp" / "1" / "model.pt"))
    return repo


@contextlib.contextmanager
def serving(repo: Path, port: int, options: Sequence[str] = ()) -> Iterator[tuple[str, str]]:
    """`sluice serve` on `repo` with its own embedded Redis, and `options`: (host:port,
    Redis URL)."""
    with EmbeddedRedis() as server:
        command = [sys.executable, "-m", "sluice", "serve", "--model-repository", str(repo)]
        command += ["--redis-url", server.url, "--http-port", str(port)]
        command += ["--grpc-port", str(port + 1), "--metrics-port", str(port + 2)]
        command += ["--log-level", "warning", *options]
        serve = subprocess.Popen(command)
        url = f"127.0.0.1:{port}"
        try:
            wait_ready(url)
            yield url, server.url
        finally:
            serve.terminate()
            serve.wait(STOP_TIMEOUT_S)


def sluice_sweep(
    repo: Path, label: str, levels: list[int], port: int, protocol: str = "http"
) -> list[dict]:
    with serving(repo, port) as (url, redis_url):
        client = redis.Redis.from_url(redis_url)
        return [run_load(url, c, label, client, protocol) for c in levels]


def wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        try:
            with urllib.request.urlopen(
                f"http://{url}/v2/models/mlp/ready", timeout=READY_TIMEOUT_S
            ) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(READY_POLL_S)
    raise RuntimeError(f"{url} did not become ready")


def triton_sweep(
    mbs: int, label: str, levels: list[int], port: int, protocol: str = "http"
) -> list[dict]:
    if not (ANCHORS / "venv").exists() or not ANCHOR.exists():
        print("PyTriton anchor not installed (bash ../shared/anchor/setup.sh): skipped")
        return []
    env = {**os.environ, "ANCHORS": str(ANCHORS)}
    subprocess.run(
        ["bash", str(ANCHOR / "start_pytriton.sh"), str(mbs), "1000", str(port)],
        check=True,
        env=env,
    )
    try:
        return [run_load(f"127.0.0.1:{port}", c, label, None, protocol) for c in levels]
    finally:
        subprocess.run(["bash", str(ANCHOR / "stop_pytriton.sh")], env=env, check=False)


def report(alone: list[dict[int, float]], rows: list[dict], protocol: str = "http") -> str:
    """The results table; ratios to the model alone use the median of its measurements."""
    bound = {b: statistics.median(m[b] for m in alone) for b in alone[0]}
    by = {(r["label"], r["concurrency"]): r for r in rows if "throughput" in r}
    levels = sorted({r["concurrency"] for r in rows})
    lines = [
        f"### Reference MLP, {datetime.date.today()} ({platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, load: "
        f"{rows[0].get('tool', '?') if rows else '?'}, {protocol})",
        "",
        f"Model alone, 1 thread, median of {len(alone)} measurements before, between and after "
        "the servers' runs (lowest-highest): "
        + ", ".join(
            f"b={b}: {bound[b]:,.0f}/s ({min(m[b] for m in alone):,.0f}-"
            f"{max(m[b] for m in alone):,.0f})"
            for b in sorted(bound)
        ),
        "",
        "| concurrency | sluice infer/s | p50 / p99 ms | avg batch | Triton infer/s | "
        "Triton p50 / p99 ms | sluice/Triton | sluice / model-bound at its batch | "
        "batching gain | Redis cmds/inference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in levels:
        s, t, one = by.get(("sluice", c)), by.get(("triton", c)), by.get(("sluice-mbs1", c))
        if s is None:
            continue
        cells = [
            str(c),
            f"{s['throughput']:,.0f}",
            f"{s['p50_ms']:.1f} / {s['p99_ms']:.1f}",
            str(s["avg_batch"]),
            f"{t['throughput']:,.0f}" if t else "-",
            f"{t['p50_ms']:.1f} / {t['p99_ms']:.1f}" if t else "-",
            f"{s['throughput'] / t['throughput']:.2f}" if t else "-",
            f"{s['throughput'] / interpolate(bound, s['avg_batch']):.2f}",
            f"{s['throughput'] / one['throughput']:.2f}" if one else "-",
            str(s.get("redis_cmds_per_inference", "-")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    first = by.get(("sluice", levels[0])) if levels else None
    if first and levels[0] == 1:
        model_ms = 1000 / bound[1]
        lines += [
            "",
            f"p50 at c=1 minus model time: {first['p50_ms'] - model_ms:.2f} ms "
            f"(model {model_ms:.2f} ms).",
        ]
        in_place, identity = first.get("compute_ms"), by.get(("sluice-identity", 1))
        if in_place is not None and identity is not None:
            lines += [
                f"At c=1 the server's compute time per forward was {in_place:.2f} ms; with an "
                f"identity model of the same signature (sluice's own path), p50 at c=1 was "
                f"{identity['p50_ms']:.2f} ms.",
            ]
    return "\n".join(lines) + "\n"


def record_results(results: Path, text: str, name: str, record: dict[str, Any]) -> None:
    """Append `text` to the results file (its dated log ends it), the figures to out/NAME.json."""
    previous = results.read_text() if results.exists() else "# Benchmark results\n\n"
    results.write_text(previous.rstrip() + "\n\n" + text)
    (results.parent / "out").mkdir(exist_ok=True)
    (results.parent / "out" / f"{name}.json").write_text(json.dumps(record, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--skip-triton", action="store_true")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if not (EXAMPLES / "mlp" / "1" / "model.pt").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "build_models.py")], check=True)
    alone: list[dict[int, float]] = []

    def measure_alone() -> None:
        alone.append(model_bound())
        print("model alone:", {b: round(v) for b, v in alone[-1].items()}, flush=True)

    measure_alone()
    protocol = args.protocol
    rows = sluice_sweep(EXAMPLES, "sluice", levels, 18700, protocol)
    measure_alone()
    batching = [c for c in levels if c >= 32]
    rows += sluice_sweep(mbs1_repository(), "sluice-mbs1", batching, 18710, protocol)
    if 1 in levels:
        rows += sluice_sweep(identity_repository(), "sluice-identity", [1], 18730, protocol)
    measure_alone()
    if not args.skip_triton:
        rows += triton_sweep(64, "triton", levels, 18720, protocol)
        measure_alone()
    text = report(alone, rows, protocol)
    print(text)
    record_results(args.results, text, "compare_triton", {"model_alone": alone, "rows": rows})


if __name__ == "__main__":
    main()
