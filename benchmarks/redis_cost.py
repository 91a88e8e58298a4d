"""What each inference costs Redis, this checkout against an earlier one, side by side.

One private Redis (loopback TCP; the server sluice serve would start, or each of `--servers`)
per side; `sluice serve --workers 1` on the reference MLP (2 KiB in and out) and on identity
models (TorchScript, FP32 in and out, max_batch_size 64, delay 1000 µs, one torch thread), each
request `--payloads` bytes in and the same out; closed-loop
load from `sluice bench` at `--concurrency`. Around each level the script diffs Redis
`INFO cpu` (the server's user + system time) and `INFO commandstats`, less the idle
background measured just before (heartbeats, recovery polls), and prints Redis CPU per
inference and per executed batch, commands per inference, the times redis-server slept and was
woken per batch (its voluntary context switches), the costliest commands, and Redis MB/s per
core (bytes in and out of the tensors, over Redis CPU seconds). With `--baseline REF`
the same runs go against the code at git REF (a worktree in a temporary folder), the two
sides alternating level by level, so that a slow spell of the machine hits both.

    python benchmarks/redis_cost.py [--baseline REF] [--payloads 64,2048,65536,1048576,4194304]
        [--concurrency 64] [--window-s 3] [--servers BINARY,BINARY]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_workers import NESTED, RedisSnapshot, command_diff, model_counts, snapshot

from sluice.bench.loadgen import run_bench
from sluice.bench.settings import BenchSettings
from sluice.embedded_redis import EmbeddedRedis, redis_server_binary, tied_to_parent

ROOT = Path(__file__).resolve().parent.parent
HTTP_PORT = 18600
REDIS_PORT = 16400
IDLE_S = 2.0
#: how long a readiness query may take, and how often a starting serve is asked again.
READY_TIMEOUT_S = 2
READY_POLL_S = 0.2
#: how long a stopped serve may take to exit before it is killed.
STOP_TIMEOUT_S = 30
#: how long `redis-server --version` may take.
VERSION_TIMEOUT_S = 10
CONFIG = """name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: 64
input [ {{ name: "INPUT__0", data_type: TYPE_FP32, dims: [ {n} ] }} ]
output [ {{ name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ {n} ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 1000 }}
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
parameters {{ key: "INTRA_OP_THREAD_COUNT" value {{ string_value: "1" }} }}
"""
#: packages the baseline's code is imported as (the layout pyproject.toml maps).
PACKAGES = {"sluice": "sluice", "gateway": "gateway", "shared": "shared", "workers": "workers"}


class Identity(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


#: the reference MLP (examples/build_models.py builds it), 2 KiB in and out: a row of its own.
REFERENCE = "mlp"
EXAMPLES = ROOT / "examples" / "model_repository"


def model_name(payload: int) -> str:
    return REFERENCE if payload == 0 else f"identity_{payload}"


def build_repository(folder: Path, payloads: list[int]) -> Path:
    """One identity model per payload size (bytes per request, FP32)."""
    scripted = torch.jit.script(Identity())
    shutil.copytree(EXAMPLES / REFERENCE, folder / REFERENCE)
    for payload in payloads:
        model = folder / model_name(payload)
        (model / "1").mkdir(parents=True)
        scripted.save(str(model / "1" / "model.pt"))
        n = max(1, payload // 4)
        (model / "config.pbtxt").write_text(CONFIG.format(name=model_name(payload), n=n))
    return folder


def baseline_tree(ref: str, folder: Path) -> Path:
    """The code at `ref`, laid out as the installed package (sluice.gateway = gateway/...), so
    that putting the folder first on PYTHONPATH runs it instead of this checkout."""
    source = folder / "source"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(source), ref],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    package = folder / "site" / "sluice"
    shutil.copytree(source / "sluice", package)
    for name in ("gateway", "shared", "workers"):
        (package / name).symlink_to(source / name)
    return folder / "site"


@dataclass(slots=True)
class Side:
    """One code version under test: its Redis and its serve."""

    label: str
    redis: EmbeddedRedis
    client: redis.Redis
    http: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def serving(
    label: str, index: int, repo: Path, pythonpath: Path | None, server: str | None, unix: bool
) -> Iterator[Side]:
    port = 0 if unix else REDIS_PORT + index
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    with (
        EmbeddedRedis(port=port, binary=server) as redis_server,
        tempfile.NamedTemporaryFile(prefix=f"redis-cost-{label}-", suffix=".log") as log,
    ):
        http_port = HTTP_PORT + 10 * index
        command = [
            *(sys.executable, "-m", "sluice", "serve", "--model-repository", str(repo)),
            *("--redis-url", redis_server.url, "--workers", "1", "--bulk-workers", "0"),
            *("--http-port", str(http_port), "--grpc-port", "0"),
            *("--metrics-port", str(http_port + 2), "--log-level", "warning"),
        ]
        process = subprocess.Popen(
            tied_to_parent(command),
            cwd=tempfile.gettempdir(),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        client = redis.Redis.from_url(redis_server.url)
        side = Side(label, redis_server, client, f"127.0.0.1:{http_port}", process)
        try:
            wait_ready(side, repo)
            yield side
        except Exception:
            log.flush()
            print(Path(log.name).read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
            client.close()


def wait_ready(side: Side, repo: Path, timeout_s: float = 180) -> None:
    deadline_s = time.monotonic() + timeout_s
    models = sorted(p.name for p in repo.iterdir())
    while time.monotonic() < deadline_s:
        if side.process.poll() is not None:
            raise RuntimeError(f"{side.label}: sluice serve exited ({side.process.returncode})")
        try:
            if all(
                urllib.request.urlopen(
                    f"http://{side.http}/v2/models/{m}/ready", timeout=READY_TIMEOUT_S
                ).status
                == 200
                for m in models
            ):
                return
        except OSError:
            pass
        time.sleep(READY_POLL_S)
    raise TimeoutError(f"{side.label}: models not ready in {timeout_s:.0f} s")


@dataclass(frozen=True, slots=True)
class Level:
    label: str
    payload: int
    throughput: float
    p99_ms: float
    inferences: int
    batch: float
    us_per_inference: float
    us_per_batch: float
    commands_per_inference: float
    #: client events Redis served (socket reads and writes), per executed batch
    reads_per_batch: float
    writes_per_batch: float
    #: times redis-server went to sleep (and so was woken), per executed batch, less idle's
    sleeps_per_batch: float
    mb_per_core_s: float
    top: str


def idle_rates(client: redis.Redis, server: EmbeddedRedis) -> tuple[float, float]:
    """Redis's CPU seconds and sleeps per second with no load (heartbeats, recovery polls)."""
    before, sleeps = snapshot(client), sleeps_so_far(server)
    time.sleep(IDLE_S)
    after = snapshot(client)
    span_s = after.at_s - before.at_s
    return (after.cpu_s - before.cpu_s) / span_s, (sleeps_so_far(server) - sleeps) / span_s


def sleeps_so_far(server: EmbeddedRedis) -> int:
    """redis-server's voluntary context switches: each a sleep in epoll_wait, then a wake-up,
    which is what a client event costs Redis most (benchmarks/RESULTS.md, Redis cost)."""
    assert server.process is not None
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    (line,) = (line for line in status.splitlines() if line.startswith("voluntary_ctxt"))
    return int(line.split()[1])


def measure(side: Side, payload: int, concurrency: int, window_s: float) -> Level:
    model = model_name(payload)
    idle = idle_rates(side.client, side.redis)
    settings = BenchSettings(
        url=side.http,
        model=model,
        concurrency=(concurrency,),
        window_ms=round(window_s * 1e3),
        max_trials=3,
        warmup_s=1.0,
        input_data="zeros",
    )
    counts0, snap0, io0 = model_counts(side.http, model), snapshot(side.client), events(side)
    level = run_bench(settings, lambda *_: None).levels[0]
    counts1, snap1, io1 = model_counts(side.http, model), snapshot(side.client), events(side)
    io = (io1[0] - io0[0], io1[1] - io0[1], io1[2] - io0[2])  # reads, writes, sleeps
    return summarise(side.label, payload, level, counts0, counts1, snap0, snap1, idle, io)


def events(side: Side) -> tuple[int, int, int]:
    """Socket reads and writes Redis has served so far (INFO stats), and its sleeps."""
    stats = side.client.info("stats")
    reads, writes = int(stats["total_reads_processed"]), int(stats["total_writes_processed"])
    return reads, writes, sleeps_so_far(side.redis)


def summarise(
    label: str,
    payload: int,
    level: object,
    counts0: tuple[int, int],
    counts1: tuple[int, int],
    snap0: RedisSnapshot,
    snap1: RedisSnapshot,
    idle: tuple[float, float],
    io: tuple[int, int, int],
) -> Level:
    inferences, executions = counts1[0] - counts0[0], counts1[1] - counts0[1]
    n, batches = max(1, inferences), max(1, executions)
    span_s = snap1.at_s - snap0.at_s
    cpu_us = max(0.0, (snap1.cpu_s - snap0.cpu_s - idle[0] * span_s) * 1e6)
    commands = command_diff(snap0, snap1)
    top_level = {k: v for k, v in commands.items() if k not in NESTED}
    costliest = sorted(top_level.items(), key=lambda kv: -kv[1][1])[:4]
    top = ", ".join(
        f"{name} {usec / calls:.0f} µs x {calls / batches:.2f}" for name, (calls, usec) in costliest
    )
    result = level.result  # type: ignore[attr-defined]
    latency = result.latency
    return Level(
        label=label,
        payload=payload,
        throughput=result.throughput,
        p99_ms=latency.p99_us / 1e3 if latency else 0.0,
        inferences=inferences,
        batch=inferences / batches,
        us_per_inference=cpu_us / n,
        us_per_batch=cpu_us / batches,
        commands_per_inference=sum(calls for calls, _ in top_level.values()) / n,
        reads_per_batch=io[0] / batches,
        writes_per_batch=io[1] / batches,
        sleeps_per_batch=max(0.0, io[2] - idle[1] * span_s) / batches,
        mb_per_core_s=(2 * (payload or 2048) * inferences / 1e6) / max(1e-9, cpu_us / 1e6),
        top=top,
    )


def size(payload: int) -> str:
    if payload == 0:
        return "2 KiB, mlp"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if payload >= scale:
            return f"{payload / scale:g} {unit}"
    return f"{payload} B"


def table(levels: list[Level]) -> str:
    head = (
        "| code | payload | infer/s | p99 ms | mean batch | Redis µs/inference | Redis µs/batch "
        "| commands/inference | Redis reads/writes per batch | Redis sleeps per batch "
        "| Redis MB/s per core | costliest (µs per call x calls per batch) |"
    )
    rows = [head, "|" + "---|" * 12]
    for lv in levels:
        rows.append(
            f"| {lv.label} | {size(lv.payload)} | {lv.throughput:,.0f} | {lv.p99_ms:.1f} "
            f"| {lv.batch:.1f} | {lv.us_per_inference:.1f} | {lv.us_per_batch:.0f} "
            f"| {lv.commands_per_inference:.3f} | {lv.reads_per_batch:.2f} / "
            f"{lv.writes_per_batch:.2f} | {lv.sleeps_per_batch:.2f} | {lv.mb_per_core_s:,.0f} "
            f"| {lv.top} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", metavar="REF", help="also run the code at git REF")
    parser.add_argument("--payloads", default="64,2048,65536,1048576,4194304")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=1, help="levels per side (median)")
    parser.add_argument(
        "--unix-socket",
        action="store_true",
        help="Redis on a Unix socket, as sluice serve runs its own (default: loopback TCP)",
    )
    parser.add_argument(
        "--servers",
        help="comma-separated redis-server binaries, each a side of its own with each code "
        "version (default: the one sluice serve starts, sluice.embedded_redis)",
    )
    args = parser.parse_args()
    payloads = [int(p) for p in args.payloads.split(",")]
    with tempfile.TemporaryDirectory(prefix="redis-cost-") as scratch:
        folder = Path(scratch)
        repo = build_repository(folder / "models", payloads)
        codes: list[tuple[str, Path | None]] = [("this checkout", None)]
        try:
            if args.baseline:
                codes.insert(0, (args.baseline, baseline_tree(args.baseline, folder / "base")))
            servers = args.servers.split(",") if args.servers else [redis_server_binary()]
            sides = [
                (code if len(servers) == 1 else f"{code}, {server_label(server)}", path, server)
                for server in servers
                for code, path in codes
            ]
            levels = run_sides(
                sides,
                repo,
                [0, *payloads],
                (args.concurrency, args.window_s, args.rounds),
                args.unix_socket,
            )
        finally:
            if args.baseline:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(folder / "base" / "source")],
                    cwd=ROOT,
                    check=False,
                    capture_output=True,
                )
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    print(
        f"\n{datetime.date.today()} at {head}, {platform.machine()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}; c={args.concurrency}, windows {args.window_s} s"
        f", Redis over {'a Unix socket' if args.unix_socket else 'loopback TCP'}"
    )
    print(table(levels))


def server_version(binary: str) -> tuple[int, ...]:
    """`binary`'s version from its --version line, (0,) if it does not say."""
    line = subprocess.run(
        [binary, "--version"],
        capture_output=True,
        text=True,
        timeout=VERSION_TIMEOUT_S,
        check=False,
    ).stdout
    match = re.search(r"\bv=(\d+)\.(\d+)\.(\d+)", line)
    return tuple(int(part) for part in match.groups()) if match else (0,)


def server_label(binary: str) -> str:
    """`binary`'s name and version: redis-server 7.0.15."""
    return f"{Path(binary).name} {'.'.join(map(str, server_version(binary)))}"


def run_sides(
    sides: list[tuple[str, Path | None, str]],
    repo: Path,
    payloads: list[int],
    load: tuple[int, float, int],
    unix: bool,
) -> list[Level]:
    concurrency, window_s, rounds = load
    with contextlib.ExitStack() as stack:
        started = [
            stack.enter_context(serving(label, i, repo, path, server, unix))
            for i, (label, path, server) in enumerate(sides)
        ]
        levels: list[Level] = []
        for payload in payloads:
            measured: dict[str, list[Level]] = {side.label: [] for side in started}
            for _ in range(rounds):
                for side in started:
                    measured[side.label].append(
                        report(measure(side, payload, concurrency, window_s))
                    )
            levels += [median_level(measured[side.label]) for side in started]
    return levels


def report(level: Level) -> Level:
    print(
        f"{level.label:>30} {size(level.payload):>10}: {level.throughput:8.0f} infer/s, "
        f"batch {level.batch:4.1f}, Redis {level.us_per_inference:6.1f} µs/inference "
        f"{level.us_per_batch:6.0f} µs/batch, {level.commands_per_inference:.3f} "
        f"cmds/inference, {level.reads_per_batch:.2f} reads/batch, "
        f"{level.sleeps_per_batch:.2f} sleeps/batch; {level.top}",
        flush=True,
    )
    return level


def median_level(levels: list[Level]) -> Level:
    """The round with the median Redis CPU per inference."""
    return sorted(levels, key=lambda lv: lv.us_per_inference)[len(levels) // 2]


if __name__ == "__main__":
    main()
