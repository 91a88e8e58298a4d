"""The gateway's own HTTP server against uvicorn and granian, side by side in one run.

One Redis and one worker on examples/model_repository's `mlp`; the gateway (the same app,
composed as `sluice gateway` composes it) is started on each server in turn and driven by
perf_analyzer (sync HTTP, batch 1, else `sluice bench`) at c=1 and c=64. The order of the
servers rotates from round to round, so a slow spell of this shared machine does not land on
one server; the table gives each figure's median over the rounds, its ratio to the own
server's, and the decision rule of issue 19 (keep the own server only if it wins clearly).

    python benchmarks/http_servers.py [--rounds 3]

uvicorn and granian come with the `[bench]` extra; perf_analyzer as benchmarks/compare_triton.py
finds it (PERF_ANALYZER and PA_LIBDIR, or the Triton anchor's under $ANCHORS).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from compare_triton import EXAMPLES, run_load, server_stats, wait_ready  # noqa: E402

from sluice.embedded_redis import EmbeddedRedis  # noqa: E402

SERVERS = ("own", "uvicorn", "granian")
LEVELS = (1, 64)
#: the issue's rule: the own server stays only if it is this much better than every other.
CLEAR_THROUGHPUT_GAIN = 0.10
CLEAR_P50_GAIN_MS = 0.2


def gateway_command(server: str, redis_url: str, port: int) -> list[str]:
    options = ["--redis-url", redis_url, "--http-port", str(port), "--grpc-port", str(port + 1)]
    options += ["--metrics-port", str(port + 2), "--log-level", "warning"]
    if server == "own":
        return [sys.executable, "-m", "sluice", "gateway", *options]
    return [sys.executable, str(ROOT / "benchmarks" / "gateway_servers.py"), server, *options]


@contextlib.contextmanager
def running(command: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    with subprocess.Popen(command) as process:
        try:
            yield process
        finally:
            process.terminate()


def cpu_time_s(pid: int) -> float:
    """CPU time (user + system) the process has used: unlike latency, what a server costs
    per request does not grow with the other loads of a shared machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(server: str, redis_url: str, port: int) -> list[dict]:
    """One server's run at each level."""
    return measure_gateway(gateway_command(server, redis_url, port), server, port)


def measure_gateway(
    command: list[str], label: str, port: int, probe: Callable[[], dict[str, float]] | None = None
) -> list[dict]:
    """A gateway started by `command` (on `port`) run at each level, each row with the
    gateway's CPU time per inference, the load average it ran under and, per inference, how
    much each of `probe`'s counters grew."""
    with running(command) as gateway:
        url = f"127.0.0.1:{port}"
        wait_ready(url)
        rows = []
        for level in LEVELS:
            inferences, cpu_s = server_stats(url)[0], cpu_time_s(gateway.pid)
            counters = probe() if probe is not None else {}
            row = run_load(url, level, label, None)
            inferences = max(1, server_stats(url)[0] - inferences)
            row["gateway_cpu_us"] = (cpu_time_s(gateway.pid) - cpu_s) * 1e6 / inferences
            row["loadavg_1m"] = round(os.getloadavg()[0], 2)
            grown = probe() if probe is not None else {}
            row |= {f"{k}_per_infer": (grown[k] - v) / inferences for k, v in counters.items()}
            rows.append(row)
        return rows


@contextlib.contextmanager
def mlp_fleet() -> Iterator[str]:
    """One Redis and one worker serving examples/model_repository's `mlp` (built if it is
    not); the Redis URL for the gateways."""
    if not (EXAMPLES / "mlp" / "1" / "model.pt").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "build_models.py")], check=True)
    with EmbeddedRedis() as redis_server:
        worker = [sys.executable, "-m", "sluice", "worker", "--model-repository", str(EXAMPLES)]
        worker += ["--models", "mlp", "--redis-url", redis_server.url, "--log-level", "warning"]
        with running(worker):
            yield redis_server.url


def orders(rounds: int) -> Iterator[tuple[str, ...]]:
    """Each round starts one server later, so each server runs first, middle and last."""
    for r in range(rounds):
        k = r % len(SERVERS)
        yield SERVERS[k:] + SERVERS[:k]


Table = dict[tuple[str, int], dict[str, float]]


def medians(rows: list[dict]) -> Table:
    """Each server's figures at each level, medians over the rounds, and against the own
    server's in the same round (paired, so the machine's drift between rounds cancels)."""
    found = {(r["label"], r["concurrency"], r["round"]): r for r in rows if "throughput" in r}
    table: Table = {}
    for server in SERVERS:
        for level in LEVELS:
            runs = [
                (r, found.get(("own", level, n)))
                for (s, c, n), r in found.items()
                if (s, c) == (server, level)
            ]
            if not runs:
                continue
            pairs = [(r, own) for r, own in runs if own is not None]
            table[(server, level)] = {
                "throughput": statistics.median(r["throughput"] for r, _ in runs),
                "p50_ms": statistics.median(r["p50_ms"] for r, _ in runs),
                "p99_ms": statistics.median(r["p99_ms"] for r, _ in runs),
                "gateway_cpu_us": statistics.median(r["gateway_cpu_us"] for r, _ in runs),
                **_spread(
                    "throughput_vs_own", [r["throughput"] / o["throughput"] for r, o in pairs]
                ),
                **_spread("p50_minus_own_ms", [r["p50_ms"] - o["p50_ms"] for r, o in pairs]),
                **_spread(
                    "cpu_vs_own", [r["gateway_cpu_us"] / o["gateway_cpu_us"] for r, o in pairs]
                ),
            }
    return table


def _spread(name: str, values: list[float]) -> dict[str, float]:
    """The median of `values` as `name`, and their lowest and highest (the noise)."""
    if not values:
        return {name: float("nan"), f"{name}_lo": float("nan"), f"{name}_hi": float("nan")}
    return {name: statistics.median(values), f"{name}_lo": min(values), f"{name}_hi": max(values)}


def decision(table: Table) -> str:
    """Issue 19's rule on the paired figures: the own server stays only if it wins clearly."""
    others = [s for s in SERVERS[1:] if (s, 64) in table and (s, 1) in table]
    if ("own", 64) not in table or ("own", 1) not in table or not others:
        return "no decision: a server has no figures"
    losing = [
        s
        for s in others
        if table[(s, 64)]["throughput_vs_own"] > 1 / (1 + CLEAR_THROUGHPUT_GAIN)
        and table[(s, 1)]["p50_minus_own_ms"] < CLEAR_P50_GAIN_MS
    ]
    if not losing:
        return "keep the own server: it wins clearly against " + ", ".join(others)
    best = max(losing, key=lambda s: table[(s, 64)]["throughput_vs_own"])
    return f"the own server does not win clearly against {', '.join(losing)}: switch to {best}"


def report(table: Table, rounds: int) -> str:
    lines = [
        f"Gateway HTTP servers, reference MLP, one worker, perf_analyzer; medians of {rounds} "
        "rounds (order rotated); against own: median (lowest, highest) of the same round's "
        "ratio or difference",
        "",
        "| server | c=1 p50 ms | c=1 p99 ms | c=1 infer/s | c=64 infer/s | c=64 p99 ms | "
        "c=64 infer/s / own | c=1 p50 - own ms | c=64 gateway CPU us/infer (/ own) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for server in SERVERS:
        one, many = table.get((server, 1)), table.get((server, 64))
        if one is None or many is None:
            lines.append(f"| {server} | failed | | | | | | | |")
            continue
        cells = [
            server,
            f"{one['p50_ms']:.2f}",
            f"{one['p99_ms']:.2f}",
            f"{one['throughput']:,.0f}",
            f"{many['throughput']:,.0f}",
            f"{many['p99_ms']:.1f}",
            _cell(many, "throughput_vs_own", "{:.2f}"),
            _cell(one, "p50_minus_own_ms", "{:+.2f}"),
            f"{many['gateway_cpu_us']:.0f} ({many['cpu_vs_own']:.2f})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", "Decision: " + decision(table)]) + "\n"


def _cell(figures: dict[str, float], name: str, form: str) -> str:
    low, high = form.format(figures[f"{name}_lo"]), form.format(figures[f"{name}_hi"])
    return f"{form.format(figures[name])} ({low}, {high})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=18740)
    parser.add_argument("--json-out", type=Path, default=ROOT / "benchmarks" / "out" / "http.json")
    args = parser.parse_args()
    rows: list[dict] = []
    with mlp_fleet() as redis_url:
        for round_number, order in enumerate(orders(args.rounds)):
            for server in order:
                port = args.port + 10 * SERVERS.index(server)  # no wait on a closing port
                for row in measure(server, redis_url, port):
                    rows.append(row | {"round": round_number})
    text = report(medians(rows), args.rounds)
    print(text)
    args.json_out.parent.mkdir(exist_ok=True)
    args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
