"""digits_ensemble against the same three steps called one after another by the client.

One `sluice serve` (embedded Redis, one worker) on examples/model_repository (build digits
first: python examples/build_models.py). The same rows of scikit-learn's digits images go
either to `digits_ensemble` (raw pixels in, label out: one request), or to `digits_pre`,
`digits`, `digits_post` in turn (three requests, each waiting for the one before): a closed
loop of c clients at c=1 and c=32, the two modes taking turns of `--window` seconds until each
had `--seconds`, so a slow spell of a shared machine lands on both alike; each mode's figures
are over all of its turns. Also what the ensemble saves (or costs) per step: its p50 against
the client chain's, divided by the three steps.

    python benchmarks/ensemble_vs_chained.py [--seconds 30] [--window 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import tritonclient.http.aio as aioclient
from sklearn.datasets import load_digits

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "model_repository"
LEVELS = (1, 32)
MODES = ("ensemble", "chained")
STEPS = ("digits_pre", "digits", "digits_post")
#: each mode and level runs this long before its turns are measured.
WARMUP_S = 1.0
#: how long a readiness query may take, and how often a starting server is asked again.
READY_TIMEOUT_S = 2
READY_POLL_S = 0.5

Call = Callable[[aioclient.InferenceServerClient, np.ndarray], Awaitable[object]]


def _input(name: str, array: np.ndarray, datatype: str) -> aioclient.InferInput:
    given = aioclient.InferInput(name, list(array.shape), datatype)
    given.set_data_from_numpy(array, binary_data=True)
    return given


async def ensemble(client: aioclient.InferenceServerClient, pixels: np.ndarray) -> object:
    result = await client.infer("digits_ensemble", [_input("PIXELS", pixels, "UINT8")])
    return result.as_numpy("LABEL")


async def chained(client: aioclient.InferenceServerClient, pixels: np.ndarray) -> object:
    image = (await client.infer("digits_pre", [_input("PIXELS", pixels, "UINT8")])).as_numpy(
        "IMAGE"
    )
    logits = (await client.infer("digits", [_input("INPUT__0", image, "FP32")])).as_numpy(
        "OUTPUT__0"
    )
    label = await client.infer("digits_post", [_input("LOGITS", logits, "FP32")])
    return label.as_numpy("LABEL")


async def closed_loop(url: str, call: Call, level: int, duration_s: float) -> list[float]:
    """`level` clients, each sending its next request when the last one is answered, for
    `duration_s`: every request's latency in seconds."""
    images = load_digits().images.astype(np.uint8)
    latencies_s: list[float] = []
    client = aioclient.InferenceServerClient(url, conn_limit=level)
    deadline_s = time.perf_counter() + duration_s

    async def one_client(index: int) -> None:
        row = index
        while time.perf_counter() < deadline_s:
            pixels = images[row % len(images)][None]
            start_s = time.perf_counter()
            await call(client, pixels)
            latencies_s.append(time.perf_counter() - start_s)
            row += level

    try:
        await asyncio.gather(*(one_client(i) for i in range(level)))
    finally:
        await client.close()
    return latencies_s


def figures(latencies_s: list[float], duration_s: float) -> dict[str, float]:
    ordered = sorted(latencies_s)
    return {
        "throughput": len(ordered) / duration_s,
        "p50_ms": ordered[len(ordered) // 2] * 1e3,
        "p99_ms": ordered[int(len(ordered) * 0.99)] * 1e3,
    }


@contextlib.contextmanager
def subprocess_running(command: list[str]) -> Iterator[None]:
    """`command` running for the block, terminated after it."""
    with subprocess.Popen(command) as process:
        try:
            yield
        finally:
            process.terminate()


def wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        try:
            ready = f"http://{url}/v2/models/digits_ensemble/ready"
            with urllib.request.urlopen(ready, timeout=READY_TIMEOUT_S) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(READY_POLL_S)
    raise RuntimeError(f"{url} did not become ready")


def report(runs: dict[tuple[str, int], dict[str, float]]) -> str:
    lines = [
        "| c | mode | throughput (inf/s) | p50 (ms) | p99 (ms) |",
        "|---|---|---|---|---|",
    ]
    medians = runs
    for (mode, level), median in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(
            f"| {level} | {mode} | {median['throughput']:.0f} | {median['p50_ms']:.2f} "
            f"| {median['p99_ms']:.2f} |"
        )
    for level in LEVELS:
        saved = medians[("chained", level)]["p50_ms"] - medians[("ensemble", level)]["p50_ms"]
        lines.append(
            f"\nc={level}: the ensemble's p50 is {saved:.2f} ms below the client chain's "
            f"({saved / len(STEPS):.2f} ms per step)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", dest="total_s", type=float, default=30.0, help="per mode and level"
    )
    parser.add_argument(
        "--window", dest="window_s", type=float, default=1.0, help="seconds per turn"
    )
    parser.add_argument("--port", type=int, default=18000)
    args = parser.parse_args()
    if not (EXAMPLES / "digits" / "1" / "model.pt").exists():
        raise SystemExit("build the example models first: python examples/build_models.py")
    command = [
        *(sys.executable, "-m", "sluice", "serve", "--model-repository", str(EXAMPLES)),
        *("--http-port", str(args.port), "--grpc-port", str(args.port + 1)),
        *("--metrics-port", str(args.port + 2), "--bulk-workers", "0", "--log-level", "warning"),
    ]
    url = f"127.0.0.1:{args.port}"
    calls: dict[str, Call] = {"ensemble": ensemble, "chained": chained}
    runs: dict[tuple[str, int], dict[str, float]] = {}
    turns = max(1, round(args.total_s / args.window_s))
    with subprocess_running(command):
        wait_ready(url)
        for level in LEVELS:
            for mode in MODES:  # warm every step and both paths
                asyncio.run(closed_loop(url, calls[mode], level, WARMUP_S))
            pooled: dict[str, list[float]] = {mode: [] for mode in MODES}
            for turn in range(turns):
                for mode in MODES if turn % 2 == 0 else MODES[::-1]:
                    pooled[mode] += asyncio.run(closed_loop(url, calls[mode], level, args.window_s))
            for mode in MODES:
                runs[(mode, level)] = figures(pooled[mode], turns * args.window_s)
                print(f"c={level} {mode}: {runs[(mode, level)]}", flush=True)
    print(report(runs))


if __name__ == "__main__":
    main()
