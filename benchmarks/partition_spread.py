"""One hot model's Redis work over the shards of a Redis Cluster: 1 partition against 3.

A model's keys share one hash tag, so a cluster keeps all of one model's stream work on one
shard, and that shard's CPU caps the model. With the config parameter PARTITIONS=3 partitions
1 and 2 get tags of their own (shared/partitions.py) and the cluster puts them on other shards.
Each side is a 3-master cluster on loopback (tests/redis_cluster.py) with `sluice serve
--workers N` on a copy of the reference MLP whose config sets PARTITIONS (1 or 3), under
closed-loop load from `sluice bench`; the sides alternate level by level, round by round, so
that a slow spell of the machine hits both. Around each level every node's `INFO cpu` is
diffed, less that node's idle background measured just before, giving Redis CPU per inference
on each shard, the busiest shard's share of it, throughput and p50/p99 latency, and the figure
the run is for: the busiest shard's CPU per inference with 3 partitions over that with 1.

On a machine with few cores Redis, the gateway, the workers and the load generator share
them, so throughput cannot grow with shards there: the spread of Redis CPU is the figure.

    python benchmarks/partition_spread.py [--concurrency 64,8] [--window-s 2] [--rounds 2]
        [--workers 1]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from compare_triton import EXAMPLES  # noqa: E402
from scale_workers import (  # noqa: E402
    MODEL,
    NESTED,
    RedisSnapshot,
    bench_settings,
    command_diff,
    model_counts,
    snapshot,
    wait_ready,
)
from sluice.shared import keys  # noqa: E402
from sluice.shared.registry import Member  # noqa: E402

from sluice.bench.loadgen import run_bench  # noqa: E402
from tests.conftest import start_service, stop_service  # noqa: E402
from tests.redis_cluster import EmbeddedCluster  # noqa: E402

IDLE_S = 2.0
PARTITIONS = (1, 3)
PARAMETER = """parameters: {{
  key: "PARTITIONS"
  value: {{ string_value: "{count}" }}
}}
"""


@dataclass(frozen=True, slots=True)
class Side:
    """One partition count under test: its cluster's nodes and its serve."""

    partitions: int
    http: str
    #: one client per master, in the cluster's port order
    nodes: tuple[redis.Redis, ...]
    #: what each node holds of the model and the fleet, in the same order
    holds: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Shards:
    """What the cluster's nodes saw at one level, per inference, in the cluster's port order."""

    #: Redis CPU (µs), net of each node's idle background
    us: tuple[float, ...]
    #: top-level Redis commands
    calls: tuple[float, ...]
    #: COMMAND calls, all nodes: redis-py's cluster client asks its default node for the keys
    #: of every command whose keys move (XREAD, XREADGROUP)
    lookups: float

    @property
    def total_us(self) -> float:
        return sum(self.us)

    @property
    def busiest_us(self) -> float:
        return max(self.us)


@dataclass(frozen=True, slots=True)
class Load:
    """What the load generator saw at one level."""

    throughput: float
    p50_ms: float
    p99_ms: float
    errors: int


@dataclass(frozen=True, slots=True)
class Level:
    partitions: int
    concurrency: int
    load: Load
    shards: Shards


def copy_repository(folder: Path, partitions: int) -> Path:
    """The reference MLP alone, its config with the PARTITIONS parameter added."""
    shutil.copytree(EXAMPLES / MODEL, folder / MODEL)
    config = folder / MODEL / "config.pbtxt"
    config.write_text(config.read_text() + PARAMETER.format(count=partitions))
    return folder


@contextlib.contextmanager
def serving(partitions: int, folder: Path, workers: int) -> Iterator[Side]:
    """A 3-master cluster and `sluice serve` on it, until the model is ready on every worker."""
    repo = copy_repository(folder / f"partitions-{partitions}", partitions)
    with EmbeddedCluster() as cluster:
        service = start_service(
            ["--model-repository", str(repo), "--redis-url", cluster.url, "--workers", str(workers)]
        )
        client = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        nodes = tuple(redis.Redis(port=port) for port in cluster.ports)
        try:
            # it reads one hash, which a cluster client does as a single server does
            wait_ready(service.http_url, client, workers)  # type: ignore[arg-type]
            yield Side(
                partitions, service.http_url, nodes, holdings(client, cluster.ports, partitions)
            )
        finally:
            stop_service(service)
            client.close()
            for node in nodes:
                node.close()


def holdings(client: redis.RedisCluster, ports: list[int], partitions: int) -> tuple[str, ...]:
    """Per node: the model's partitions, the gateways' reply streams and the fleet keys it
    holds, so that a busiest shard can be told apart from one that only holds more."""
    held: dict[int, list[str]] = {port: [] for port in ports}

    def place(key: str, what: str) -> None:
        held[client.get_node_from_key(key).port].append(what)

    for partition in range(partitions):
        place(keys.request_stream(MODEL, 0, partition), f"partition {partition}")
    for raw in client.hgetall(keys.FLEET).values():
        member = Member.decode(raw)
        if member.kind == "gateway":
            place(keys.reply_stream(member.id), "replies")
    place(keys.FLEET, "fleet")
    return tuple(", ".join(held[port]) for port in ports)


def idle_rates(side: Side) -> tuple[list[RedisSnapshot], list[float]]:
    """Each node's CPU seconds per second with the fleet idle, and the snapshots it ended at."""
    before = [snapshot(node) for node in side.nodes]
    time.sleep(IDLE_S)
    after = [snapshot(node) for node in side.nodes]
    return after, [
        (b.cpu_s - a.cpu_s) / (b.at_s - a.at_s) for a, b in zip(before, after, strict=True)
    ]


def measure(side: Side, concurrency: int, window_s: float) -> Level:
    snaps0, idle = idle_rates(side)
    counts0 = model_counts(side.http)
    level = run_bench(bench_settings(side.http, concurrency, window_s), lambda *_: None).levels[0]
    counts1 = model_counts(side.http)
    snaps1 = [snapshot(node) for node in side.nodes]
    inferences = max(1, counts1[0] - counts0[0])
    node_us = tuple(
        max(0.0, s1.cpu_s - s0.cpu_s - rate * (s1.at_s - s0.at_s)) * 1e6 / inferences
        for s0, s1, rate in zip(snaps0, snaps1, idle, strict=True)
    )
    diffs = [command_diff(s0, s1) for s0, s1 in zip(snaps0, snaps1, strict=True)]
    node_calls = tuple(
        sum(calls for name, (calls, _) in diff.items() if name not in NESTED) / inferences
        for diff in diffs
    )
    lookups = (
        sum(
            calls
            for diff in diffs
            for name, (calls, _) in diff.items()
            if name.partition("|")[0] == "command"  # Redis 7 names it command|getkeys
        )
        / inferences
    )
    latency = level.result.latency
    load = Load(
        throughput=level.result.throughput,
        p50_ms=latency.p50_us / 1e3 if latency else 0.0,
        p99_ms=latency.p99_us / 1e3 if latency else 0.0,
        errors=level.result.errors,
    )
    print(
        f"partitions {side.partitions} c={concurrency:3d}: {load.throughput:6.0f} infer/s, "
        f"p99 {load.p99_ms:6.1f} ms, Redis µs/inference per node {joined(node_us, 1)}, "
        f"commands per inference per node {joined(node_calls, 2)} (COMMAND {lookups:.2f}), "
        f"errors {load.errors}",
        flush=True,
    )
    return Level(side.partitions, concurrency, load, Shards(node_us, node_calls, lookups))


def joined(figures: tuple[float, ...], digits: int) -> str:
    return " / ".join(f"{x:.{digits}f}" for x in figures)


def columns(rows: Iterable[tuple[float, ...]]) -> tuple[float, ...]:
    """The mean of each column."""
    return tuple(fmean(column) for column in zip(*rows, strict=True))


def mean_level(levels: list[Level]) -> Level:
    """The rounds of one side and concurrency, averaged figure by figure."""
    loads, shards = [lv.load for lv in levels], [lv.shards for lv in levels]
    throughput, p50, p99 = columns((x.throughput, x.p50_ms, x.p99_ms) for x in loads)
    load = Load(throughput, p50, p99, sum(x.errors for x in loads))
    return Level(
        levels[0].partitions,
        levels[0].concurrency,
        load,
        Shards(
            columns(x.us for x in shards),
            columns(x.calls for x in shards),
            fmean(x.lookups for x in shards),
        ),
    )


def table(levels: list[Level], holds: dict[int, tuple[str, ...]]) -> str:
    rows = [
        "| partitions | concurrency | infer/s | p50 / p99 ms | Redis CPU µs/inference, all "
        "nodes | per node | busiest node | busiest share | Redis commands/inference per node "
        "| of them COMMAND | errors |",
        "|" + "---|" * 11,
    ]
    for lv in levels:
        load, shards = lv.load, lv.shards
        busiest = shards.us.index(shards.busiest_us)
        rows.append(
            f"| {lv.partitions} | {lv.concurrency} | {load.throughput:,.0f} | {load.p50_ms:.1f} / "
            f"{load.p99_ms:.1f} | {shards.total_us:.1f} | {joined(shards.us, 1)} "
            f"| {busiest} ({holds[lv.partitions][busiest]}) | "
            f"{shards.busiest_us / max(1e-9, shards.total_us):.0%} | "
            f"{joined(shards.calls, 2)} | {shards.lookups:.2f} | {load.errors} |"
        )
    return "\n".join(rows)


def ratios(levels: list[Level], concurrency: list[int], holds: tuple[str, ...]) -> list[str]:
    """3 partitions against 1, per concurrency; `holds`: the 3-partition side's layout, whose
    nodes holding a partition and nothing else show one partition's work alone."""
    by = {(lv.partitions, lv.concurrency): lv for lv in levels}
    alone = [i for i, held in enumerate(holds) if held.startswith("partition") and "," not in held]
    lines = []
    for c in concurrency:
        one, three = by[(1, c)], by[(3, c)]
        partition_us = fmean(three.shards.us[i] for i in alone) if alone else 0.0
        top = max(1e-9, one.shards.busiest_us)
        lines.append(
            f"c={c}: busiest shard CPU per inference, 3 partitions / 1 partition = "
            f"{three.shards.busiest_us / top:.2f}; a shard with one partition and nothing else "
            f"{partition_us / top:.2f}; all shards together "
            f"{three.shards.total_us / max(1e-9, one.shards.total_us):.2f}; throughput "
            f"{three.load.throughput / max(1e-9, one.load.throughput):.2f}"
        )
    return lines


def checkout() -> str:
    """The commit measured (the working tree may hold more)."""
    command = ["git", "rev-parse", "--short", "HEAD"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True).stdout.strip()


def run(concurrency: list[int], window_s: float, rounds: int, workers: int) -> None:
    with (
        tempfile.TemporaryDirectory(prefix="partition-spread-") as scratch,
        contextlib.ExitStack() as stack,
    ):
        sides = [stack.enter_context(serving(p, Path(scratch), workers)) for p in PARTITIONS]
        for side in sides:
            layout = "; ".join(f"node {i}: {held}" for i, held in enumerate(side.holds))
            print(f"partitions {side.partitions}: {layout}", flush=True)
        measured: dict[tuple[int, int], list[Level]] = {}
        for round_ in range(rounds):
            for c in concurrency:
                # the side that goes first changes every round
                for side in sides[:: 1 if round_ % 2 == 0 else -1]:
                    measured.setdefault((side.partitions, c), []).append(measure(side, c, window_s))
        holds = {side.partitions: side.holds for side in sides}
    levels = [mean_level(measured[(p, c)]) for c in concurrency for p in PARTITIONS]
    print(
        f"\n{datetime.date.today()} at {checkout()}, {platform.machine()}, load average "
        f"{os.getloadavg()[0]:.1f}; `sluice serve --workers {workers}` on a 3-master cluster "
        f"on loopback, windows of {window_s} s, mean of {rounds} rounds"
    )
    print(table(levels, holds))
    print("\n".join(ratios(levels, concurrency, holds[3])))
    print(
        f"{os.cpu_count()} cores: the gateway, the workers, six Redis nodes and the load "
        "generator share them, so throughput does not scale with shards here; the spread of "
        "Redis CPU over the shards is the figure."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="64,8")
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    if not (EXAMPLES / MODEL / "1" / "model.pt").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "build_models.py")], check=True)
    started_s = time.monotonic()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    run(concurrency, args.window_s, args.rounds, args.workers)
    print(f"took {time.monotonic() - started_s:.0f} s")


if __name__ == "__main__":
    main()
