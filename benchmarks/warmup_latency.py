"""The first request after a model loads, with and without Triton's model warm-up.

A backend initialises lazily: torch profiles and optimises a TorchScript graph on its first
calls, ONNX Runtime grows its memory arena, TensorFlow traces its graph. Without warm-up the
first client request after a load pays for that; with `model_warmup` in the config, sample
requests run on every instance before the model is ready (workers/instances/warmup.py), so the
load takes longer and the first request should cost what the others do. This measures both.

For each example model (TorchScript `mlp`, ONNX `mlp_onnx`, TensorFlow `mlp_tf`, built by
examples/build_models.py) and each mode (its config as it is; the same config with one
zero-data warm-up sample of batch 1 added), it copies the model alone into a temporary
repository, starts `sluice serve` on it (embedded Redis, one worker) on free ports, waits until
`GET /v2/models/<m>/ready` answers 200, times the first HTTP JSON inference (batch 1, random
data) and then the next STEADY ones, and stops the server (SIGTERM). Each pair runs `--repeats`
times, the two modes alternating.

    python benchmarks/warmup_latency.py [--repeats 3] [--models mlp,mlp_onnx,mlp_tf]
        [--warmup-count 1]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "model_repository"
SLUICE = ROOT / ".venv" / "bin" / "sluice"
#: the example models measured: their kind, input name, config data type and dims (without
#: the batch dim), as their config.pbtxt declares them.
MODELS = {
    "mlp": ("TorchScript", "INPUT__0", "TYPE_FP32", [512]),
    "mlp_onnx": ("ONNX", "INPUT__0", "TYPE_FP32", [512]),
    "mlp_tf": ("TensorFlow", "INPUT__0", "TYPE_FP32", [512]),
}
MODES = ("without warm-up", "with warm-up")
STEADY = 20
FIRST_PORT = 18100  # the search for three free ports in a row starts here (not 8000-8002)
READY_TIMEOUT_S = 300.0
POLL_S = 0.02


@dataclass
class Run:
    """One server's life: seconds from its start to the model's ready, and request times."""

    ready_s: float
    first_ms: float
    steady_ms: float
    next_ms: tuple[float, ...]  # the requests right after the first


def warmup_config(model: str, count: int) -> str:
    """The `model_warmup` setting of one zero-data sample of batch 1 for `model`, run `count`
    times."""
    _, name, data_type, dims = MODELS[model]
    value = f"data_type: {data_type} dims: {dims} zero_data: true"
    sample = (
        f'name: "w" batch_size: 1 count: {count} inputs {{ key: "{name}" value: {{ {value} }} }}'
    )
    return f"\nmodel_warmup [ {{ {sample} }} ]\n"


def make_repository(model: str, warmups: int, into: Path) -> Path:
    """A repository holding a copy of `model` alone, its config with a warm-up sample run
    `warmups` times (0: none)."""
    repo = into / "models"
    shutil.copytree(EXAMPLES / model, repo / model)
    if warmups:
        with (repo / model / "config.pbtxt").open("a") as config:
            config.write(warmup_config(model, warmups))
    return repo


def free_port_run(start: int = FIRST_PORT, count: int = 3) -> int:
    """The first port from `start` on such that it and the `count - 1` after it are free."""
    for port in range(start, 65536 - count):
        with contextlib.ExitStack() as stack:
            try:
                for offset in range(count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no {count} free ports in a row from {start}")


def request(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    """One HTTP request on a connection of its own: the status and the body."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(method, path, body, {"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def wait_ready(process: subprocess.Popen[bytes], port: int, model: str, log: Path) -> None:
    """Return once `model` is ready; raise with the server's log if it exits or never is."""
    deadline_s = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline_s:
        if process.poll() is not None:
            raise RuntimeError(f"sluice serve exited ({process.returncode}):\n{log.read_text()}")
        with contextlib.suppress(OSError):
            if request(port, "GET", f"/v2/models/{model}/ready")[0] == 200:
                return
        time.sleep(POLL_S)
    _, index = request(port, "POST", "/v2/repository/index", b"{}")
    raise RuntimeError(f"{model} not ready in {READY_TIMEOUT_S:.0f} s: {index.decode()}")


def infer_bodies(model: str, count: int) -> list[bytes]:
    """`count` JSON inference requests of one row of random data each."""
    _, name, _, dims = MODELS[model]
    rng = np.random.default_rng()
    return [
        json.dumps(
            {
                "inputs": [
                    {
                        "name": name,
                        "shape": [1, *dims],
                        "datatype": "FP32",
                        "data": rng.standard_normal(dims).astype(np.float32).ravel().tolist(),
                    }
                ]
            }
        ).encode()
        for _ in range(count)
    ]


def timed_requests(port: int, model: str, bodies: list[bytes]) -> list[float]:
    """Each body sent in turn on one connection: its round trip in ms (ValueError: refused)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    times_ms = []
    try:
        for body in bodies:
            start_s = time.perf_counter()
            connection.request(
                "POST", f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"}
            )
            answer = connection.getresponse()
            text = answer.read()
            times_ms.append((time.perf_counter() - start_s) * 1e3)
            if answer.status != 200:
                raise ValueError(f"{model}: {answer.status} {text[:500]!r}")
    finally:
        connection.close()
    return times_ms


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM and wait; its process group is killed if anything of it is left."""
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # a child left behind by the serve command


def one_run(model: str, warmups: int) -> Run:
    """Start a server on `model` alone, time its first and steady requests, stop it."""
    bodies = infer_bodies(model, 1 + STEADY)
    with tempfile.TemporaryDirectory(prefix="warmup-") as folder:
        repo = make_repository(model, warmups, Path(folder))
        port = free_port_run()
        log = Path(folder) / "serve.log"
        command = [str(SLUICE), "serve", "--model-repository", str(repo)]
        command += ["--http-port", str(port), "--grpc-port", str(port + 1)]
        command += ["--metrics-port", str(port + 2)]
        with log.open("wb") as out:
            start_s = time.perf_counter()
            process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                wait_ready(process, port, model, log)
                ready_s = time.perf_counter() - start_s
                times_ms = timed_requests(port, model, bodies)
            finally:
                stop(process)
    return Run(ready_s, times_ms[0], statistics.median(times_ms[1:]), tuple(times_ms[1:4]))


def table(runs: dict[tuple[str, str], list[Run]]) -> str:
    """The markdown table of the runs, one row per (model, mode)."""
    lines = [
        "| model | mode | start to ready s | first request ms, median (min-max) "
        f"| next {STEADY} ms, median | first / steady |",
        "|---|---|---|---|---|---|",
    ]
    for (model, mode), done in runs.items():
        firsts = [run.first_ms for run in done]
        first = statistics.median(firsts)
        steady = statistics.median(run.steady_ms for run in done)
        ready = statistics.median(run.ready_s for run in done)
        lines.append(
            f"| {model} ({MODELS[model][0]}) | {mode} | {ready:.1f} "
            f"| {first:.1f} ({min(firsts):.1f}-{max(firsts):.1f}) | {steady:.2f} "
            f"| {first / steady:.1f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (model, mode)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--warmup-count", type=int, default=1, help="the sample's count")
    args = parser.parse_args()
    models = args.models.split(",")
    missing = [model for model in models if not (EXAMPLES / model / "config.pbtxt").exists()]
    if missing:
        raise SystemExit(f"missing {missing}: run .venv/bin/python examples/build_models.py")
    print("$ python benchmarks/warmup_latency.py " + shlex.join(sys.argv[1:]))
    print("warm-up: " + warmup_config(models[0], args.warmup_count).strip())
    print(f"load average at start: {os.getloadavg()}")
    runs: dict[tuple[str, str], list[Run]] = {
        (model, mode): [] for model in models for mode in MODES
    }
    for repeat in range(args.repeats):
        for model in models:
            for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                run = one_run(model, args.warmup_count if mode == MODES[1] else 0)
                runs[model, mode].append(run)
                print(
                    f"  {model} {mode}: ready {run.ready_s:.1f} s, first {run.first_ms:.1f} ms,"
                    f" then {', '.join(f'{ms:.1f}' for ms in run.next_ms)},"
                    f" steady {run.steady_ms:.2f} ms",
                    flush=True,
                )
    print(f"load average at end: {os.getloadavg()}")
    print(table(runs))


if __name__ == "__main__":
    main()
