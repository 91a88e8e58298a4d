"""sluice with 1, 2 and 4 worker processes on one machine, and what each inference costs Redis.

For each worker count, `sluice serve --workers N` runs against one private Redis (loopback
TCP, as a fleet reaches its Redis over the network) on the reference MLP (max_batch_size 64,
delay 1000 µs, torch 1 thread per worker) under closed-loop load from `sluice bench`. Around
every load level the script diffs Redis `INFO commandstats` and `INFO cpu`, so it reports
Redis commands and Redis CPU (µs) per inference; an idle spell per worker count gives the
background (heartbeats, recovery polls) to subtract. A least-squares fit over all levels
splits Redis CPU into a cost per executed batch and a cost per request, and the model alone
(in-process, batch 1/8/32/64) gives the batch service time t(b) = a + c·b. Both calibrate
`benchmarks/fleet_sim.py`.

On a 2-core machine the workers compete with the gateway, Redis and the load generator for
the same cores: more workers cannot add throughput here. The point of the run is the
per-inference Redis cost.

    python benchmarks/scale_workers.py [--workers 1,2,4] [--concurrency 64,128] \
        [--json benchmarks/out/scale_workers.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from compare_triton import EXAMPLES, model_bound  # noqa: E402
from sluice.shared import keys  # noqa: E402
from sluice.shared.registry import Member  # noqa: E402

from sluice.bench.loadgen import run_bench  # noqa: E402
from sluice.bench.settings import BenchSettings  # noqa: E402
from sluice.embedded_redis import EmbeddedRedis, tied_to_parent  # noqa: E402

MODEL = "mlp"
HTTP_PORT = 18400
METRICS_PORT = 18500
REDIS_PORT = 16391
#: a level with small batches, so that the per-batch / per-request fit sees both ends
LOW_CONCURRENCY = 8
IDLE_S = 3.0
#: how long a readiness or statistics query may take.
READY_TIMEOUT_S = 2
STATS_TIMEOUT_S = 10
#: how often a starting serve is asked again whether it is ready.
READY_POLL_S = 0.5
#: how long a stopped serve may take to exit before it is killed.
STOP_TIMEOUT_S = 60
#: how long a ready fleet runs before its idle background is measured: past the first
#: heartbeats and recovery polls.
SETTLE_S = 1.0
#: commands only run inside the batch script here; their time is already in EVAL's
NESTED = frozenset({"hincrby", "hget", "xack", "xdel"})
#: commands on the model's keys; the rest is the reply stream (XREAD, XTRIM, half of XADD:
#: see shard_split) and fleet-wide keys (heartbeats)
MODEL_SIDE = frozenset({"eval", "evalsha", "xreadgroup", "xautoclaim", "xclaim", "script"})


@dataclass(frozen=True, slots=True)
class RedisSnapshot:
    """Cumulative Redis counters at one instant."""

    at_s: float
    cpu_s: float
    #: command -> (calls, usec); INFO itself left out
    commands: dict[str, tuple[int, int]]

    def total_calls(self) -> int:
        return sum(calls for calls, _ in self.commands.values())


@dataclass(frozen=True, slots=True)
class LevelRecord:
    workers: int
    concurrency: int
    throughput: float
    p50_ms: float
    p99_ms: float
    stable: bool
    errors: int
    seconds: float
    inferences: int
    executions: int
    avg_batch: float
    redis_cmds: int
    redis_cpu_us: float
    cmds_per_inference: float
    cpu_us_per_inference: float
    #: the same, less the idle background over the same time
    net_cpu_us_per_inference: float
    #: share of Redis command time on the model's keys (its hash slot), see shard_split
    model_slot_share: float
    #: executed batch size -> count, over the bench's last windows
    batch_sizes: dict[int, int]
    per_command: dict[str, dict[str, float]]


def snapshot(client: redis.Redis) -> RedisSnapshot:
    cpu = client.info("cpu")
    stats = client.info("commandstats")
    commands = {
        name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
        for name, v in stats.items()
        if name != "cmdstat_info"
    }
    return RedisSnapshot(
        time.monotonic(), float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), commands
    )


def command_diff(before: RedisSnapshot, after: RedisSnapshot) -> dict[str, tuple[int, int]]:
    out = {}
    for name, (calls, usec) in after.commands.items():
        c0, u0 = before.commands.get(name, (0, 0))
        if calls > c0:
            out[name] = (calls - c0, usec - u0)
    return out


def shard_split(commands: dict[str, tuple[int, int]]) -> float:
    """Share of top-level command time spent on the model's keys rather than reply streams.

    In a Redis Cluster the model's keys share one slot (hash tag `{m:<model>}`) while each
    gateway's reply stream has its own, so this share is what a single hot model puts on its
    shard. XADD serves both sides (request entries in, result entries out); the reference
    MLP's inputs and outputs are the same size, so its time is split half and half.
    """
    usec = {name: u for name, (_, u) in commands.items() if name not in NESTED}
    total = sum(usec.values())
    model = sum(usec.get(n, 0) for n in MODEL_SIDE) + usec.get("xadd", 0) / 2
    return model / total if total else 1.0


def model_counts(http: str, model: str = MODEL) -> tuple[int, int]:
    """(inferences, executions) of the model so far, from the Triton statistics endpoint."""
    with urllib.request.urlopen(
        f"http://{http}/v2/models/{model}/stats", timeout=STATS_TIMEOUT_S
    ) as r:
        stats = json.load(r)["model_stats"]
    return (
        sum(int(s["inference_count"]) for s in stats),
        sum(int(s["execution_count"]) for s in stats),
    )


def ready_workers(client: redis.Redis) -> int:
    members = [Member.decode(raw) for raw in client.hgetall(keys.FLEET).values()]
    return sum(
        1
        for m in members
        if m.kind == "worker" and MODEL in m.models and m.models[MODEL].ready_versions
    )


def wait_ready(http: str, client: redis.Redis, workers: int, timeout_s: float = 180) -> None:
    """Until the gateway answers and every worker has loaded the model."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        try:
            with urllib.request.urlopen(
                f"http://{http}/v2/models/{MODEL}/ready", timeout=READY_TIMEOUT_S
            ) as r:
                if r.status == 200 and ready_workers(client) >= workers:
                    return
        except OSError:
            pass
        time.sleep(READY_POLL_S)
    raise RuntimeError(f"sluice serve with {workers} workers did not become ready")


@contextlib.contextmanager
def sluice_serve(redis_url: str, workers: int) -> Iterator[str]:
    """`sluice serve --workers N`; yields host:port, stops the whole group afterwards."""
    port = HTTP_PORT + workers
    log = serve_log(workers)
    process = subprocess.Popen(
        tied_to_parent(
            [
                sys.executable,
                "-m",
                "sluice",
                "serve",
                "--model-repository",
                str(EXAMPLES),
                "--redis-url",
                redis_url,
                "--workers",
                str(workers),
                "--http-port",
                str(port),
                "--metrics-port",
                str(METRICS_PORT + workers),
                "--log-level",
                "warning",
            ]
        ),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"127.0.0.1:{port}"
    except Exception:
        log.flush()
        print(Path(log.name).read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def serve_log(workers: int) -> IO[bytes]:
    """Where serve's output goes, so that the table stays readable; shown if a run fails."""
    return tempfile.NamedTemporaryFile(prefix=f"sluice-serve-{workers}w-", suffix=".log")


def background(client: redis.Redis, window_s: float = IDLE_S) -> tuple[float, float]:
    """Redis (CPU µs/s, commands/s) with the fleet idle."""
    before = snapshot(client)
    time.sleep(window_s)
    after = snapshot(client)
    span_s = after.at_s - before.at_s
    return (after.cpu_s - before.cpu_s) * 1e6 / span_s, (
        after.total_calls() - before.total_calls()
    ) / span_s


def bench_settings(http: str, concurrency: int, window_s: float) -> BenchSettings:
    return BenchSettings(
        url=http,
        model=MODEL,
        concurrency=(concurrency,),
        window_ms=round(window_s * 1e3),
        max_trials=4,
        warmup_s=1.0,
    )


def measure_level(
    http: str, client: redis.Redis, workers: int, concurrency: int, window_s: float, idle_cpu: float
) -> LevelRecord:
    """One closed-loop level; Redis and model counters diffed around the whole of it."""
    counts0, snap0 = model_counts(http), snapshot(client)
    level = run_bench(bench_settings(http, concurrency, window_s), lambda *_: None).levels[0]
    counts1, snap1 = model_counts(http), snapshot(client)
    inferences, executions = counts1[0] - counts0[0], counts1[1] - counts0[1]
    commands = command_diff(snap0, snap1)
    span_s = snap1.at_s - snap0.at_s
    cpu_us = (snap1.cpu_s - snap0.cpu_s) * 1e6
    n = max(1, inferences)
    latency = level.result.latency
    record = LevelRecord(
        workers=workers,
        concurrency=concurrency,
        throughput=round(level.result.throughput, 1),
        p50_ms=round(latency.p50_us / 1e3, 2) if latency else 0.0,
        p99_ms=round(latency.p99_us / 1e3, 2) if latency else 0.0,
        stable=level.stable,
        errors=level.result.errors,
        seconds=round(span_s, 2),
        inferences=inferences,
        executions=executions,
        avg_batch=round(inferences / max(1, executions), 2),
        redis_cmds=sum(calls for calls, _ in commands.values()),
        redis_cpu_us=round(cpu_us),
        cmds_per_inference=round(sum(c for c, _ in commands.values()) / n, 3),
        cpu_us_per_inference=round(cpu_us / n, 2),
        net_cpu_us_per_inference=round((cpu_us - idle_cpu * span_s) / n, 2),
        model_slot_share=round(shard_split(commands), 3),
        batch_sizes=level.result.server.batch_sizes if level.result.server else {},
        per_command={
            name: {"calls_per_inference": round(c / n, 4), "usec_per_inference": round(u / n, 3)}
            for name, (c, u) in sorted(commands.items())
        },
    )
    print(
        f"workers {workers} c={concurrency:3d}: {record.throughput:7.1f} infer/s  "
        f"p99 {record.p99_ms:6.1f} ms  batch {record.avg_batch:5.1f}  "
        f"Redis {record.cmds_per_inference:.3f} cmds, {record.cpu_us_per_inference:.1f} µs "
        f"CPU per inference; batches of 1-2: {small_batches(record.batch_sizes):.0%}",
        flush=True,
    )
    return record


def small_batches(sizes: dict[int, int]) -> float:
    """Share of executions that ran 1 or 2 requests (a sign of requests caught alone)."""
    total = sum(sizes.values())
    return sum(n for b, n in sizes.items() if b <= 2) / total if total else 0.0


def fit_costs(rows: list[LevelRecord], idle_cpu: dict[int, float]) -> dict[str, float]:
    """Least squares: net Redis CPU = per_batch x executions + per_request x inferences.

    Redis work is O(1) per batch (one read, one reply XADD, one ack script) plus a little per
    request (its tensors are copied in and out); the split makes per-inference cost a
    function of batch size, which is what the fleet simulation needs.
    """
    x = np.array([[r.executions, r.inferences] for r in rows], dtype=float)
    cpu = np.array([r.redis_cpu_us - idle_cpu[r.workers] * r.seconds for r in rows])
    cmds = np.array([r.redis_cmds for r in rows], dtype=float)
    return {
        "cpu_us_per_batch": round(float(nonnegative_lstsq(x, cpu)[0]), 2),
        "cpu_us_per_request": round(float(nonnegative_lstsq(x, cpu)[1]), 3),
        "cmds_per_batch": round(float(nonnegative_lstsq(x, cmds)[0]), 3),
        "cmds_per_request": round(float(nonnegative_lstsq(x, cmds)[1]), 4),
        "model_slot_share": round(
            sum(r.model_slot_share * r.inferences for r in rows)
            / max(1, sum(r.inferences for r in rows)),
            3,
        ),
    }


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Two-column least squares; a negative coefficient is pinned to 0 and the other refit."""
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    if (coef >= 0).all():
        return coef
    keep = int(np.argmax(coef))
    out = np.zeros(2)
    column = x[:, keep]
    out[keep] = max(0.0, float(column @ y / (column @ column)))
    return out


def fit_service(bound: dict[int, float]) -> dict[str, float]:
    """t(b) = a + c·b through the model-alone figures, least squares on relative error."""
    sizes = np.array(sorted(bound), dtype=float)
    batch_times_s = np.array([b / bound[int(b)] for b in sizes])
    weights = 1 / batch_times_s
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    a, c = np.linalg.lstsq(design, batch_times_s * weights, rcond=None)[0]
    return {"a_ms": round(float(a) * 1e3, 4), "c_ms": round(float(c) * 1e3, 5)}


def run_workers(
    client: redis.Redis, url: str, workers: int, levels: list[int], window_s: float
) -> tuple[list[LevelRecord], float, float]:
    client.flushall()
    with sluice_serve(url, workers) as http:
        wait_ready(http, client, workers)
        time.sleep(SETTLE_S)
        idle_cpu, idle_cmds = background(client)
        print(
            f"workers {workers}: idle Redis {idle_cpu:.0f} µs CPU/s, {idle_cmds:.1f} cmds/s",
            flush=True,
        )
        rows = [measure_level(http, client, workers, c, window_s, idle_cpu) for c in levels]
    return rows, idle_cpu, idle_cmds


def table(rows: list[LevelRecord]) -> str:
    lines = [
        "| workers | concurrency | infer/s | p50 / p99 ms | avg batch | Redis cmds/inference "
        "| Redis CPU µs/inference | net of idle | batches of 1-2 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.workers} | {r.concurrency} | {r.throughput:,.0f} | "
            f"{r.p50_ms:.1f} / {r.p99_ms:.1f} | {r.avg_batch:.1f} | {r.cmds_per_inference:.3f} | "
            f"{r.cpu_us_per_inference:.1f} | {r.net_cpu_us_per_inference:.1f} | "
            f"{small_batches(r.batch_sizes):.0%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--concurrency", default="64,128")
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--redis-port", type=int, default=REDIS_PORT, help="0: a Unix socket")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    if not (EXAMPLES / "mlp" / "1" / "model.pt").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "build_models.py")], check=True)
    started_s = time.monotonic()
    bound = model_bound(trials=2, trial_s=1.0)
    service = fit_service(bound)
    print("model alone, 1 thread:", {b: round(v) for b, v in bound.items()}, "infer/s;", service)
    rows: list[LevelRecord] = []
    idle: dict[int, dict[str, float]] = {}
    with EmbeddedRedis(port=args.redis_port) as server:
        client = redis.Redis.from_url(server.url)
        for n in counts:
            # one level with small batches for the first count, so the fit sees both ends
            extra = [LOW_CONCURRENCY] if n == counts[0] else []
            found, cpu, cmds = run_workers(client, server.url, n, extra + levels, args.window_s)
            rows += found
            idle[n] = {"cpu_us_per_s": round(cpu), "cmds_per_s": round(cmds, 1)}
        client.close()
    costs = fit_costs(rows, {n: v["cpu_us_per_s"] for n, v in idle.items()})
    print()
    print(table(rows))
    print()
    print("Redis cost fit:", costs)
    print(
        f"{os.cpu_count()} cores: workers share them with the gateway, Redis and the load "
        "generator, so more workers cannot add throughput here; the per-inference Redis cost "
        "is the point of this run."
    )
    print(f"took {time.monotonic() - started_s:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document: dict[str, Any] = {
            "date": str(datetime.date.today()),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "redis": "loopback TCP" if args.redis_port else "unix socket",
            "model_bound": {str(b): round(v, 1) for b, v in bound.items()},
            "service_time": service,
            "idle": {str(n): v for n, v in idle.items()},
            "redis_cost": costs,
            "levels": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(document, indent=1))
        print("wrote", args.json)


if __name__ == "__main__":
    main()
