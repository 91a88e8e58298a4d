"""TorchScript, PyTorch 2 (.pt2, AOTInductor), ONNX Runtime, OpenVINO and TensorFlow on the
reference MLP, side by side in one run: the same weights as `mlp`, `mlp_pt2`, `mlp_onnx`,
`mlp_openvino` and `mlp_tf` of the example repository.

(a) Model-bound: each model loaded in this process by the worker's own backend
(`sluice.workers.backends.load_function`, as a worker loads it: one intra-op thread), called on
batches of 1 and 64 rows in turns (one trial of each backend after another, so that the drift
of a shared machine spreads over them all); rows per second, median of the trials.
(b) Served: one `sluice serve` (embedded Redis, one worker) on a repository holding the
models with their example configs (dynamic batching, delay 1000 µs, max_batch_size 64),
driven by Triton's perf_analyzer (sync HTTP, batch 1) at c=1 and c=64, each round taking the
models in another order; medians over the rounds, and the mean batch the worker ran (server
statistics). Without perf_analyzer, `sluice bench` drives it (HTTP, same levels).

    python examples/build_models.py && python benchmarks/backends.py [--rounds 2]

perf_analyzer as benchmarks/compare_triton.py finds it (PERF_ANALYZER and PA_LIBDIR, or the
Triton anchor's under $ANCHORS). A model whose file is not built, or whose backend is not
installed (`mlp_onnx` needs the [onnx] extra, `mlp_openvino` the [openvino] one, `mlp_tf` the
[tensorflow] one), is reported as skipped with the reason.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from compare_triton import EXAMPLES, perf_analyzer  # noqa: E402
from http_servers import running  # noqa: E402
from sluice.shared.errors import SluiceError  # noqa: E402
from sluice.shared.model_config import load_model_config  # noqa: E402
from sluice.workers.backends import load_function  # noqa: E402

from sluice.embedded_redis import EmbeddedRedis  # noqa: E402

#: example model -> the backend it shows
MODELS = {
    "mlp": "TorchScript",
    "mlp_pt2": "PyTorch 2 (.pt2)",
    "mlp_onnx": "ONNX Runtime",
    "mlp_openvino": "OpenVINO",
    "mlp_tf": "TensorFlow",
}
BATCHES = (1, 64)
LEVELS = (1, 64)
#: 3 s windows, stable within 50 % over up to 8: a shared 2-core machine rarely settles to 10 %
#: how long a readiness or statistics query may take.
READY_TIMEOUT_S = 2
STATS_TIMEOUT_S = 10
#: how often a starting server is asked again whether it is ready.
READY_POLL_S = 0.5
#: the longest one load run (perf_analyzer's or sluice bench's) may take.
RUN_TIMEOUT_S = 600
PA_WINDOW = ["-p", "3000", "-s", "50", "-r", "8"]

Infer = Callable[[dict[str, Any]], dict[str, Any]]


def load(model: str) -> Infer | str:
    """The example model as a worker loads it, or why it cannot be."""
    model_dir = EXAMPLES / model
    try:
        spec = load_model_config(model_dir)
        if not (model_dir / "1" / spec.model_filename).exists():
            return f"{model}/1/{spec.model_filename} not built (python examples/build_models.py)"
        return load_function(spec, model_dir, 1, torch.device("cpu"), 0)
    except SluiceError as exc:
        return str(exc)


def model_bound(trials: int, trial_s: float) -> dict[tuple[str, int], float | str]:
    """Rows per second of each model alone, per batch size (median of the trials)."""
    torch.set_num_threads(1)
    loaded = {model: load(model) for model in MODELS}
    runnable = {m: f for m, f in loaded.items() if not isinstance(f, str)}
    rates: dict[tuple[str, int], list[float]] = {(m, b): [] for m in runnable for b in BATCHES}
    with torch.inference_mode():
        for batch in BATCHES:
            inputs = {"INPUT__0": torch.randn(batch, 512)}
            for infer in runnable.values():
                for _ in range(20):
                    infer(inputs)
            for _ in range(trials):
                for model, infer in runnable.items():
                    calls, start_s = 0, time.perf_counter()
                    while time.perf_counter() - start_s < trial_s:
                        infer(inputs)
                        calls += 1
                    rates[(model, batch)].append(calls * batch / (time.perf_counter() - start_s))
    out: dict[tuple[str, int], float | str] = {
        key: statistics.median(values) for key, values in rates.items()
    }
    for model, reason in loaded.items():
        if isinstance(reason, str):
            out |= {(model, batch): reason for batch in BATCHES}
    return out


def repository(models: list[str]) -> Path:
    """The example models' configs and files, alone in a repository of their own."""
    repo = Path(tempfile.mkdtemp(prefix="backends-")) / "models"
    for model in models:
        shutil.copytree(EXAMPLES / model, repo / model)
    return repo


def model_stats(url: str, model: str) -> tuple[int, int]:
    with urllib.request.urlopen(
        f"http://{url}/v2/models/{model}/stats", timeout=STATS_TIMEOUT_S
    ) as r:
        stats = json.load(r)["model_stats"][0]
    return stats["inference_count"], stats["execution_count"]


def wait_ready(url: str, models: list[str], timeout_s: float = 180) -> None:
    deadline_s = time.monotonic() + timeout_s
    for model in models:
        while True:
            try:
                with urllib.request.urlopen(
                    f"http://{url}/v2/models/{model}/ready", timeout=READY_TIMEOUT_S
                ):
                    break
            except OSError:
                if time.monotonic() > deadline_s:
                    raise RuntimeError(f"{model} did not become ready on {url}") from None
                time.sleep(READY_POLL_S)


def load_once(url: str, model: str, level: int) -> dict[str, float | str]:
    """One level's figures for one model: perf_analyzer's, else `sluice bench`'s."""
    inferences, executions = model_stats(url, model)
    pa = perf_analyzer()
    folder = Path(tempfile.mkdtemp())
    if pa is not None:
        command = [pa[0], "-m", model, "-i", "http", "-u", url, "--concurrency-range", str(level)]
        run = subprocess.run(
            [*command, *PA_WINDOW, "-f", str(folder / "pa.csv")],
            env=pa[1],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        if run.returncode != 0 or not (folder / "pa.csv").exists():
            lines = (run.stdout + run.stderr).strip().splitlines()
            failures = [line for line in lines if "rror" in line or "ailed" in line]
            return {"error": " ".join((failures or lines)[-1:])}
        row = next(csv.DictReader((folder / "pa.csv").open()))
        record: dict[str, float | str] = {
            "throughput": float(row["Inferences/Second"]),
            "p50_ms": int(row["p50 latency"]) / 1e3,
            "p99_ms": int(row["p99 latency"]) / 1e3,
        }
    else:
        command = [sys.executable, "-m", "sluice", "bench", "--url", url, "--model", model]
        command += ["--concurrency", str(level), "--json-out", str(folder / "bench.json")]
        subprocess.run(command, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
        result = json.loads((folder / "bench.json").read_text())["levels"][0]["result"]
        if result["latency"] is None:
            return {"error": str(result["error_kinds"] or "no request succeeded")}
        record = {
            "throughput": result["throughput"],
            "p50_ms": result["latency"]["p50_us"] / 1e3,
            "p99_ms": result["latency"]["p99_us"] / 1e3,
        }
    after = model_stats(url, model)
    record["batch"] = (after[0] - inferences) / max(1, after[1] - executions)
    record["loadavg"] = os.getloadavg()[0]
    return record


def served(models: list[str], rounds: int, port: int) -> dict[tuple[str, int], list[dict]]:
    repo = repository(models)
    runs: dict[tuple[str, int], list[dict]] = {(m, c): [] for m in models for c in LEVELS}
    with EmbeddedRedis() as redis_server:
        command = [sys.executable, "-m", "sluice", "serve", "--model-repository", str(repo)]
        command += ["--redis-url", redis_server.url, "--http-port", str(port)]
        command += ["--grpc-port", str(port + 1), "--metrics-port", str(port + 2)]
        with running([*command, "--bulk-workers", "0", "--log-level", "warning"]):
            url = f"127.0.0.1:{port}"
            wait_ready(url, models)
            for n in range(rounds):
                for level in LEVELS:
                    for model in models[n % len(models) :] + models[: n % len(models)]:
                        row = load_once(url, model, level)
                        print(f"served {model} c={level}: {row}", flush=True)
                        runs[(model, level)].append(row)
    return runs


def report(
    alone: dict[tuple[str, int], float | str], runs: dict[tuple[str, int], list[dict]]
) -> str:
    lines = [
        "| backend (model) | alone b=1 rows/s | alone b=64 rows/s | c=1 infer/s | c=1 p50 ms "
        "| c=1 p99 ms | c=64 infer/s | c=64 p50 ms | c=64 p99 ms | c=64 mean batch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, backend in MODELS.items():
        cells = [f"{backend} (`{model}`)"]
        for batch in BATCHES:
            value = alone[(model, batch)]
            cells.append(f"{value:,.0f}" if isinstance(value, float) else "skipped")
        for level in LEVELS:
            ok = [r for r in runs.get((model, level), []) if "error" not in r]
            if not ok:
                cells += ["-", "-", "-"] + (["-"] if level == LEVELS[-1] else [])
                continue

            def median(key: str, rows: list[dict] = ok) -> float:
                return statistics.median(float(r[key]) for r in rows)

            cells += [
                f"{median('throughput'):,.0f}",
                f"{median('p50_ms'):.2f}",
                f"{median('p99_ms'):.2f}",
            ]
            if level == LEVELS[-1]:
                cells.append(f"{median('batch'):.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    skipped = {m: v for (m, _), v in alone.items() if isinstance(v, str)}
    lines += [f"\n{model} skipped: {reason}" for model, reason in skipped.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="served rounds (median)")
    parser.add_argument("--trials", type=int, default=3, help="model-bound trials (median)")
    parser.add_argument(
        "--seconds", dest="trial_s", type=float, default=1.0, help="per model-bound trial"
    )
    parser.add_argument("--port", type=int, default=18900)
    args = parser.parse_args()
    alone = model_bound(args.trials, args.trial_s)
    for (model, batch), value in alone.items():
        print(f"alone {model} b={batch}: {value}", flush=True)
    models = [m for m in MODELS if not isinstance(alone[(m, BATCHES[0])], str)]
    runs = served(models, args.rounds, args.port) if models else {}
    print(f"\nload average {os.getloadavg()[0]:.1f}; torch {torch.__version__}")
    print(report(alone, runs))


if __name__ == "__main__":
    main()
