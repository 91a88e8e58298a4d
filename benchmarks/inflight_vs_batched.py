"""In-flight batching against request-level dynamic batching, on the example charlm.

One `sluice serve` (its own embedded Redis, loopback, one worker) serves the same charlm
weights two ways (benchmarks/charlm_modes.py): `charlm_inflight`, whose sequences join and
leave the running batch between steps, and `charlm_batched`, whose batches run until their
longest sequence ends. Same max_batch_size, one instance each, one torch thread, each step
at least `--step-ms` (a stand-in for an accelerator, see charlm_modes.py; 0: the bare CPU
model).

The load is open-loop: Poisson arrivals at an offered rate, each request asking for an
exponential number of tokens (mean 128, capped at 512, at least 1), generated exactly (no stop
character); the lengths and prompts are one seeded sequence, the same for every rate and
mode. The client reads HTTP /generate_stream (one SSE event per token) and records each
request's send time and each token's arrival.

Per run: tokens/s over the arrival window (its first quarter, at most 2 s, left out as the
ramp), TTFT p50/p99 of every request sent (one still without a token at the end counts with
its wait so far, a lower bound), inter-token latency p50/p99, requests completed with exactly
their tokens. First a sweep per mode, the offered rate growing by `--factor` until tokens/s
grows less than 5 % while short of the offered; then both modes at the in-flight mode's
saturation (the highest swept rate it served: tokens/s at least 95 % of the offered) and at
70 % of it. Capacity: a sweep's highest tokens/s.

    python benchmarks/inflight_vs_batched.py [--step-ms 3] [--sweep-seconds 8] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from charlm_modes import MODES, build_repository  # noqa: E402

PLOT = ROOT / "benchmarks" / "inflight_vs_batched.png"
PROMPTS = ("def ", "The ", "class ", "import ", "for ", "If the ", "return ", "A ")
MEAN_TOKENS = 128
#: the start of a run left out of its tokens/s, as its arrivals ramp up (at most a quarter
#: of its arrival window).
RAMP_CAP_S = 2.0
#: how long a readiness query may take, and how often a starting serve is asked again.
READY_TIMEOUT_S = 2
READY_POLL_S = 0.3
#: the pause after a run: cancelled streams end and the instance is free before the next.
SETTLE_S = 1.0
#: how long one whole generation may take in the modes' same-text check.
GENERATE_TIMEOUT_S = 60
#: one run's figures, as printed (JSON) and tabled.
Row = dict[str, Any]
HEADER = (
    "| mode | offered req/s | offered tokens/s | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms"
    " | completed | load 1m |",
    "|---|---|---|---|---|---|---|---|",
)


@dataclass(frozen=True)
class Planned:
    """One request of the load: when it is sent (s after the start), its prompt and length."""

    at_s: float
    prompt: str
    tokens: int


@dataclass
class Record:
    """What the client saw of one request."""

    planned: Planned
    sent_s: float = math.nan
    tokens_at_s: list[float] = field(default_factory=list)
    done: bool = False
    error: str = ""


def plan(rate: float, window_s: float, cap: int, seed: int = 0) -> list[Planned]:
    """Poisson arrivals at `rate` for `window_s`; lengths and prompts from a sequence of their
    own, so every rate and mode sees the same requests in the same order."""
    gaps_s = np.random.default_rng(seed).exponential(1 / rate, size=int(rate * window_s * 2) + 16)
    times_s = np.cumsum(gaps_s)
    times_s = times_s[times_s < window_s]
    drawn = np.random.default_rng(seed + 1).exponential(MEAN_TOKENS, size=len(times_s))
    lengths = np.minimum(cap, np.ceil(drawn))
    prompts = np.random.default_rng(seed + 2).integers(len(PROMPTS), size=len(times_s))
    return [
        Planned(float(at_s), PROMPTS[p], max(1, int(n)))
        for at_s, p, n in zip(times_s, prompts, lengths, strict=True)
    ]


@dataclass
class Run:
    """One open-loop run: its records, when it started, its arrival window, when it ended."""

    records: list[Record]
    start_s: float
    window_s: float
    end_s: float

    def figures(self) -> Row:
        ramp_s = min(RAMP_CAP_S, self.window_s / 4)
        low_s, high_s = self.start_s + ramp_s, self.start_s + self.window_s
        arrivals_s = [at_s for r in self.records for at_s in r.tokens_at_s]
        in_window = sum(low_s <= at_s < high_s for at_s in arrivals_s)
        sent = [r for r in self.records if not math.isnan(r.sent_s)]
        ttft_s = [(r.tokens_at_s[0] if r.tokens_at_s else self.end_s) - r.sent_s for r in sent]
        itl_s = [
            b - a for r in sent for a, b in zip(r.tokens_at_s, r.tokens_at_s[1:], strict=False)
        ]
        completed = [r for r in sent if r.done and len(r.tokens_at_s) == r.planned.tokens]
        offered = sum(r.planned.tokens for r in self.records) / self.window_s
        return {
            "requests": len(self.records),
            "offered_tokens_per_s": offered,
            "completed": len(completed),
            "wrong_length": sum(r.done and len(r.tokens_at_s) != r.planned.tokens for r in sent),
            "errors": sum(bool(r.error) for r in sent),
            "tokens_per_s": in_window / (high_s - low_s),
            "ttft_p50_ms": percentile(ttft_s, 50) * 1e3,
            "ttft_p99_ms": percentile(ttft_s, 99) * 1e3,
            "itl_p50_ms": percentile(itl_s, 50) * 1e3,
            "itl_p99_ms": percentile(itl_s, 99) * 1e3,
        }


async def one_request(
    session: aiohttp.ClientSession, url: str, start_s: float, planned: Planned, record: Record
) -> None:
    await asyncio.sleep(max(0.0, start_s + planned.at_s - time.monotonic()))
    body = {"text_input": planned.prompt, "max_tokens": planned.tokens, "stop": ""}
    record.sent_s = time.monotonic()
    async with session.post(url, json=body) as answer:
        if answer.status != 200:
            record.error = f"{answer.status}: {(await answer.text())[:200]}"
            return
        async for line in answer.content:
            if line.startswith(b"data: "):
                if b'"error"' in line:
                    record.error = line[6:].decode(errors="replace")[:200]
                    return
                record.tokens_at_s.append(time.monotonic())
    record.done = True


async def open_loop(url: str, load: list[Planned], window_s: float, drain_s: float) -> Run:
    """Send `load` on schedule; stop waiting `drain_s` after the last arrival (closing the
    streams still open cancels their requests)."""
    records = [Record(p) for p in load]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start_s = time.monotonic()
        tasks = [
            asyncio.ensure_future(one_request(session, url, start_s, p, r))
            for p, r in zip(load, records, strict=True)
        ]
        _, pending = await asyncio.wait(tasks, timeout=window_s + drain_s)
        end_s = time.monotonic()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return Run(records, start_s, window_s, end_s)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(repo: Path, log: Path) -> Iterator[str]:
    """`sluice serve` on `repo` (embedded Redis, its output to `log`) until every model is
    ready: its HTTP address."""
    http, grpc, metrics = free_port(), free_port(), free_port()
    command = [
        *(sys.executable, "-m", "sluice", "serve", "--model-repository", str(repo)),
        *("--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)),
        *("--bulk-workers", "0", "--log-level", "warning"),
    ]
    with (
        log.open("wb") as out,
        subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=out) as process,
    ):
        try:
            url = f"http://127.0.0.1:{http}"
            for mode in MODES:
                wait_ready(f"{url}/v2/models/charlm_{mode}/ready")
            yield url
        finally:
            process.terminate()


def wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(url, timeout=READY_TIMEOUT_S) as answer,
        ):
            if answer.status == 200:
                return
        time.sleep(READY_POLL_S)
    raise RuntimeError(f"{url} not ready")


def measure(url: str, mode: str, rate: float, window_s: float, args: argparse.Namespace) -> Row:
    load = plan(rate, window_s, args.cap, args.seed)
    endpoint = f"{url}/v2/models/charlm_{mode}/generate_stream"
    run = asyncio.run(open_loop(endpoint, load, window_s, args.drain_s))
    time.sleep(SETTLE_S)
    row = {"mode": mode, "rate": round(rate, 3), "seconds": window_s, **run.figures()}
    row["load_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(row), flush=True)
    return row


def same_text(url: str, prompt: str = "def ", tokens: int = 200) -> None:
    """Both modes generate the same greedy text for one prompt (same weights, same code), each
    of exactly `tokens` characters: else the comparison would be of different work."""
    texts = []
    for mode in MODES:
        body = json.dumps({"text_input": prompt, "max_tokens": tokens, "stop": ""}).encode()
        endpoint = f"{url}/v2/models/charlm_{mode}/generate_stream"
        with urllib.request.urlopen(
            urllib.request.Request(endpoint, body), timeout=GENERATE_TIMEOUT_S
        ) as answer:
            events = [line[6:] for line in answer.read().splitlines() if line.startswith(b"data: ")]
        texts.append("".join(json.loads(event)["text_output"] for event in events))
    if texts[0] != texts[1] or len(texts[0]) != tokens:
        raise SystemExit(f"the modes disagree: {texts!r}")
    print(f"both modes generate the same {tokens} characters from {prompt!r}", flush=True)


def sweep(url: str, mode: str, args: argparse.Namespace) -> list[Row]:
    """Rates from `--start-rate` up by `--factor` until tokens/s grows less than 5 % over the
    best so far while falling 10 % short of the offered tokens/s (a short run's lengths vary
    too much for growth alone), or `--max-points`."""
    rows: list[Row] = []
    rate, best = args.start_rate, 0.0
    for _ in range(args.max_points):
        rows.append(measure(url, mode, rate, args.sweep_s, args))
        got = rows[-1]["tokens_per_s"]
        if got < best * 1.05 and got < 0.9 * rows[-1]["offered_tokens_per_s"]:
            break
        best, rate = max(best, got), rate * args.factor
    return rows


def capacity(rows: list[Row]) -> Row:
    """The sweep's point of highest tokens/s."""
    return max(rows, key=lambda row: row["tokens_per_s"])


def saturation(rows: list[Row]) -> Row:
    """The sweep's highest rate still served: tokens/s at least 95 % of those offered (past it
    a queue grows for as long as the run lasts)."""
    kept_up = [row for row in rows if row["tokens_per_s"] >= 0.95 * row["offered_tokens_per_s"]]
    return max(kept_up or rows[:1], key=lambda row: row["rate"])


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def report(sweeps: dict[str, list[Row]], finals: list[Row], args: argparse.Namespace) -> str:
    lines = [
        f"step at least {args.step_ms} ms, max_batch_size {args.max_batch_size}, lengths "
        f"exponential mean {MEAN_TOKENS} capped at {args.cap}, sweep runs {args.sweep_s} s,"
        f" final runs {args.final_s} s, drain {args.drain_s} s",
        "",
        "Sweep (capacity: the highest tokens/s; saturation: the highest rate served, tokens/s at"
        " least 95 % of those offered):",
        "",
        *HEADER,
    ]
    for rows in sweeps.values():
        top, served = capacity(rows), saturation(rows)
        for row in rows:
            marks = [name for name, at in (("capacity", top), ("saturation", served)) if row is at]
            lines.append(row_line(row, f" ({', '.join(marks)})" if marks else ""))
    lines += [
        "",
        "At equal offered load: the in-flight mode's saturation rate and 70 % of it:",
        "",
        *HEADER,
    ]
    lines += [row_line(row, "") for row in finals]
    lines.append("")
    for index in range(0, len(finals), 2):
        inflight, batched = finals[index], finals[index + 1]
        lines.append(
            f"- at {inflight['rate']} req/s: tokens/s in-flight / batched "
            f"{ratio(inflight['tokens_per_s'], batched['tokens_per_s'])}; TTFT p99 batched / "
            f"in-flight {ratio(batched['ttft_p99_ms'], inflight['ttft_p99_ms'])}; TTFT p50 "
            f"batched / in-flight {ratio(batched['ttft_p50_ms'], inflight['ttft_p50_ms'])}"
        )
    every = [row for rows in sweeps.values() for row in rows] + finals
    lines.append(
        f"- requests that ended with another number of tokens than asked: "
        f"{sum(row['wrong_length'] for row in every)}; with an error: "
        f"{sum(row['errors'] for row in every)}"
    )
    top = {mode: capacity(rows)["tokens_per_s"] for mode, rows in sweeps.items()}
    lines.append(
        f"- capacity (highest tokens/s of each sweep) in-flight / batched: "
        f"{ratio(top['inflight'], top['batched'])}"
    )
    return "\n".join(lines)


def row_line(row: Row, mark: str) -> str:
    return (
        f"| {row['mode']}{mark} | {row['rate']:.2f} | {row['offered_tokens_per_s']:.0f} | "
        f"{row['tokens_per_s']:.0f} | "
        f"{row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f} | "
        f"{row['itl_p50_ms']:.1f} / {row['itl_p99_ms']:.1f} | "
        f"{row['completed']}/{row['requests']} | {row['load_1m']} |"
    )


def plot(sweeps: dict[str, list[Row]], finals: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (tokens, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    offered = sorted((r["rate"], r["offered_tokens_per_s"]) for r in sweeps["inflight"])
    tokens.plot(*zip(*offered, strict=True), ":", color="grey", label="offered")
    for mode, color in zip(MODES, ("tab:blue", "tab:orange"), strict=True):
        rows = sorted(sweeps[mode], key=lambda r: r["rate"])
        final = [r for r in finals if r["mode"] == mode]
        for axes, key, scale in ((tokens, "tokens_per_s", 1.0), (ttft, "ttft_p99_ms", 1e-3)):
            axes.plot(
                [r["rate"] for r in rows],
                [r[key] * scale for r in rows],
                "o-",
                color=color,
                label=f"{mode} (sweep)",
            )
            axes.plot(
                [r["rate"] for r in final],
                [r[key] * scale for r in final],
                "s",
                color=color,
                markersize=9,
                fillstyle="none",
                label=f"{mode} (final)",
            )
    tokens.set(xlabel="offered requests/s", ylabel="tokens/s", title="throughput")
    ttft.set(xlabel="offered requests/s", ylabel="TTFT p99 (s)", title="time to first token")
    ttft.set_yscale("log")
    for axes in (tokens, ttft):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=3.0, help="each step's least time")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--cap", type=int, default=512, help="the most tokens of a request")
    parser.add_argument("--start-rate", type=float, default=6.0, help="requests/s")
    parser.add_argument("--factor", type=float, default=1.4)
    parser.add_argument("--max-points", type=int, default=8)
    parser.add_argument("--sweep-seconds", dest="sweep_s", type=float, default=8.0)
    parser.add_argument("--seconds", dest="final_s", type=float, default=20.0)
    parser.add_argument(
        "--drain", dest="drain_s", type=float, default=4.0, help="seconds after the arrivals"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=PLOT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        repo = build_repository(Path(folder), args.max_batch_size, args.step_ms, args.cap)
        log = Path(folder) / "serve.log"
        with serving(repo, log) as url:
            same_text(url)
            for mode in MODES:  # warm both
                measure(url, mode, 2.0, 2.0, args)
            sweeps = {mode: sweep(url, mode, args) for mode in MODES}
            rate = saturation(sweeps["inflight"])["rate"]
            finals = [
                measure(url, mode, level, args.final_s, args)
                for level in (rate, 0.7 * rate)
                for mode in MODES
            ]
        errors = [line for line in log.read_text().splitlines() if " ERROR " in line]
    print(report(sweeps, finals, args))
    if errors:
        print(f"the server logged {len(errors)} ERROR line(s), the first: {errors[0]}")
    plot(sweeps, finals, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
