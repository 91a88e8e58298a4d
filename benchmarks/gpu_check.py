"""GPU check: the reference MLP and a wide MLP on KIND_GPU, each model alone, through the
worker's batch path, and served (sluice serve, `sluice bench` at c=1 and c=64), with the GPU's
utilisation read from NVML during each served level.

    bash benchmarks/gpu_check.sh                  # on a machine with one GPU (sets up a venv)
    python benchmarks/gpu_check.py --cpu-dry-run  # the same steps, tiny and on the CPU

Columns: `alone` is the model's forward at batch 64 on inputs already on the device (what the
GPU can do); `worker path` is a StackedInstance's run on 64 one-row requests through the
instance's staging (pinned buffers, its stream, outputs back to the host: the worker without
Redis or HTTP);
`staged ahead` is that path on a lane's thread with each next batch's inputs copied ahead
while the lane computes (`sluice.workers.devices.stage_ahead`, one instance's overlap);
`c=N` is served throughput with N clients of one row each, its median latency, the mean batch
the model ran and the GPU's mean utilisation over the level; `gRPC c=64` the same over gRPC
(benchmarks/grpc_load.py). Then the reference MLP at c=256 over HTTP and gRPC with one gateway
and with several on its ports (`--gateways`, one per four cores). Figures go to --out
(default $OUT, if set) as gpu_check.json and gpu_check.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
from backends import load_once, wait_ready  # noqa: E402
from build_models import save_torchscript  # noqa: E402
from compare_triton import EXAMPLES  # noqa: E402
from gpu_answers import (  # noqa: E402
    BATCHES,
    TOLERANCE,
    batch_path_errors,
    instance,
    one_row_requests,
    served_error,
)
from grpc_load import grpc_load  # noqa: E402
from http_servers import running  # noqa: E402
from sluice.shared import device_metrics as dm  # noqa: E402
from sluice.shared.model_config import load_model_config  # noqa: E402
from sluice.workers.backends import load_function  # noqa: E402
from sluice.workers.devices.cuda_staging import Staged  # noqa: E402
from sluice.workers.devices.device_sampler import GpuSampler, cuda_gpu_uuids, open_nvml  # noqa: E402
from sluice.workers.devices.stage_ahead import StageAhead  # noqa: E402
from sluice.workers.instances.model_instance import Batch  # noqa: E402

from sluice.cores import cores_available  # noqa: E402
from sluice.embedded_redis import EmbeddedRedis  # noqa: E402

BATCH = 64
LEVELS = (1, 64)
#: the level at which one gateway and several (--gateways) are compared, and how many: one
#: per four cores, as serve's default, at least two.
GATEWAY_LEVEL = 256
#: seconds of each gRPC load (grpc_load.py), and with --cpu-dry-run.
GRPC_S = 8.0
DRY_GRPC_S = 2.0
#: sluice bench's windows: short, so four levels fit the check's 10 minutes with room to spare.
BENCH_ENV = {"SLUICE_BENCH_WINDOW_MS": "2000", "SLUICE_BENCH_MAX_TRIALS": "6"}
DRY_BENCH_ENV = {"SLUICE_BENCH_WINDOW_MS": "1000", "SLUICE_BENCH_MAX_TRIALS": "3"}
#: NVML's utilisation covers the last 1/6 s to 1 s: read a few times a second.
SAMPLE_S = 0.2
#: how long each model-alone and worker-path figure is measured with --cpu-dry-run.
DRY_MEASURE_S = 0.5


@dataclass(frozen=True, slots=True)
class Wide:
    """An MLP of `layers` hidden layers `hidden` wide, `width` in and out."""

    width: int
    hidden: int
    layers: int

    def module(self, device: torch.device) -> torch.nn.Module:
        torch.manual_seed(0)
        sizes = [self.width, *[self.hidden] * self.layers, self.width]
        layers: list[torch.nn.Module] = []
        for a, b in itertools.pairwise(sizes):
            layers += [torch.nn.Linear(a, b, device=device), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1]).eval()  # no ReLU after the last layer


#: 4096 -> 4 x 8192 -> 4096, FP32: 268 M parameters, 34 GFLOP a batch of 64.
WIDE = Wide(4096, 8192, 4)
DRY_WIDE = Wide(256, 512, 2)

CONFIG = """name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: {batch}
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ {width} ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ {width} ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 1000 }}
instance_group [ {{ count: 2 kind: {kind} }} ]
"""


def repository(root: Path, wide: Wide, device: torch.device) -> dict[str, int]:
    """The reference MLP (examples/build_models.py's) and the wide MLP, two instances each on
    `device`'s kind; each model's input width."""
    kind = "KIND_GPU" if device.type == "cuda" else "KIND_CPU"
    if not (EXAMPLES / "mlp" / "1" / "model.pt").exists():
        raise SystemExit("build the reference MLP first: python examples/build_models.py")
    (root / "mlp" / "1").mkdir(parents=True)
    shutil.copy(EXAMPLES / "mlp" / "1" / "model.pt", root / "mlp" / "1" / "model.pt")
    (root / "wide" / "1").mkdir(parents=True)
    example = torch.zeros(1, wide.width, device=device)
    save_torchscript(wide.module(device), example, root / "wide" / "1" / "model.pt")
    widths = {"mlp": 512, "wide": wide.width}
    for name, width in widths.items():
        config = CONFIG.format(name=name, batch=BATCH, width=width, kind=kind)
        (root / name / "config.pbtxt").write_text(config)
    return widths


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alone(model_dir: Path, width: int, device: torch.device, measure_s: float) -> float:
    """Rows per second of the model's forward at batch 64, its inputs on the device."""
    spec = load_model_config(model_dir)
    infer = load_function(spec, model_dir, 1, device, 0)
    inputs = {"INPUT__0": torch.randn(BATCH, width, device=device)}
    with torch.inference_mode():
        for _ in range(10):
            infer(inputs)
        synchronize(device)
        calls, start_s = 0, time.perf_counter()
        while time.perf_counter() - start_s < measure_s:
            for _ in range(10):
                infer(inputs)
            synchronize(device)
            calls += 10
    return calls * BATCH / (time.perf_counter() - start_s)


def _batch_path(model_dir: Path, width: int, device: torch.device) -> tuple[Any, ...]:
    """The model's spec, one loaded instance, its staging and 64 one-row requests."""
    spec, stacked, staging = instance(model_dir, device)
    return spec, stacked, staging, one_row_requests("", torch.randn(1, width).expand(BATCH, -1))


def worker_path(model_dir: Path, width: int, device: torch.device, measure_s: float) -> float:
    """Rows per second of the worker's batch path (stack, copy in, run, copy out, cut) on 64
    one-row requests, through an instance's staging on a GPU."""
    _, stacked, staging, requests = _batch_path(model_dir, width, device)
    batch = Batch(requests, [1] * BATCH, staging=staging)
    for _ in range(10):
        stacked.run(batch)
    batches, start_s = 0, time.perf_counter()
    while time.perf_counter() - start_s < measure_s:
        stacked.run(batch)
        batches += 1
    return batches * BATCH / (time.perf_counter() - start_s)


def staged_path(model_dir: Path, width: int, device: torch.device, measure_s: float) -> float:
    """The same path on one lane's thread, each next batch's inputs staged ahead on this
    thread while the lane runs the current one, as the batch loop does on a GPU."""
    spec, stacked, staging, requests = _batch_path(model_dir, width, device)
    sizes, ahead = [1] * BATCH, StageAhead(spec, device)

    def run(staged: Staged | None) -> object:
        return stacked.run(Batch(requests, sizes, staging=staging, staged=staged))

    batches, start_s = 0, time.perf_counter()
    with ThreadPoolExecutor(1) as lane:
        running = lane.submit(run, None)
        while time.perf_counter() - start_s < measure_s:
            ahead.stage(requests)
            running.result()
            running = lane.submit(run, ahead.take(requests))
            batches += 1
        running.result()
    return (batches + 1) * BATCH / (time.perf_counter() - start_s)


def unless_it_fails(figure: Callable[..., float], *args: Any) -> float | None:
    """The figure, or None with the failure printed: one path failing on a GPU machine must
    not cost the check's other figures."""
    try:
        return figure(*args)
    except Exception as exc:
        print(f"{figure.__name__} failed: {exc!r}", flush=True)
        return None


class Utilisation:
    """The GPUs' mean NVML utilisation while the block runs (None: no GPU or no NVML)."""

    def __init__(self, gpus: GpuSampler | None) -> None:
        self.gpus = gpus
        self.readings: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        assert self.gpus is not None
        while not self._stop.wait(SAMPLE_S):
            for sample in self.gpus.sample().values():
                if dm.GPU_UTILIZATION.name in sample:
                    self.readings.append(float(sample[dm.GPU_UTILIZATION.name]))

    def __enter__(self) -> Utilisation:
        if self.gpus is not None:
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.readings) if self.readings else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def served(
    repo: Path,
    widths: dict[str, int],
    device: torch.device,
    gpus: GpuSampler | None,
    gateways: int,
    grpc_s: float,
) -> dict[str, dict[str, Any]]:
    """Each model's figures at each level (HTTP) and at c=64 over gRPC, served by sluice serve
    on an embedded Redis, and whether one request's answer is the model's; then the reference
    MLP at c=256 over both protocols with one gateway and with `gateways` on its ports."""
    models = list(widths)
    rows: dict[str, dict[str, Any]] = {}
    for count in sorted({1, gateways}):
        ports = [free_port() for _ in range(3)]
        with EmbeddedRedis() as redis_server:
            command = [sys.executable, "-m", "sluice", "serve", "--model-repository", str(repo)]
            command += ["--redis-url", redis_server.url, "--http-port", str(ports[0])]
            command += ["--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])]
            command += ["--bulk-workers", "0", "--log-level", "warning", "--gateways", str(count)]
            with running(command):
                url, target = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
                wait_ready(url, models)
                if count == 1:
                    rows |= _per_model(url, target, repo, widths, device, gpus, grpc_s)
                for protocol in ("http", "grpc"):
                    if protocol == "http":
                        row = load_once(url, "mlp", GATEWAY_LEVEL)
                    else:
                        row = grpc_load(target, "mlp", widths["mlp"], GATEWAY_LEVEL, grpc_s)
                    print(
                        f"{count} gateway(s), mlp {protocol} c={GATEWAY_LEVEL}: {row}", flush=True
                    )
                    rows[f"gateways={count} {protocol}"] = row
    return rows


def _per_model(
    url: str,
    target: str,
    repo: Path,
    widths: dict[str, int],
    device: torch.device,
    gpus: GpuSampler | None,
    grpc_s: float,
) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for model in widths:
        error = unless_it_fails(served_error, url, model, repo / model, widths[model], device)
        rows[f"{model} answer"] = {"relative_error": error}
        print(f"served {model} answer, relative to the model's: {error}", flush=True)
        for level in LEVELS:
            with Utilisation(gpus) as utilisation:
                row = load_once(url, model, level)
            row["gpu_util"] = utilisation.mean
            print(f"served {model} c={level}: {row}", flush=True)
            rows[f"{model} c={level}"] = row
        row = grpc_load(target, model, widths[model], LEVELS[-1], grpc_s)
        print(f"served {model} gRPC c={LEVELS[-1]}: {row}", flush=True)
        rows[f"{model} grpc"] = row
    return rows


def cell(value: object, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def answers(figures: dict[str, Any], model: str) -> str:
    """`right` when every path answered as the model does, else which did not and by how much."""
    paths = figures["answers"].get(model) or {}
    errors = {
        "worker path": paths.get("worker_path"),
        "staged ahead": paths.get("staged_path"),
        "served": figures["served"].get(f"{model} answer", {}).get("relative_error"),
    }
    wrong = [
        f"{path} {'failed' if error is None else format(error, '.1e')}"
        for path, error in errors.items()
        if error is None or error > TOLERANCE
    ]
    verdict = "WRONG: " + ", ".join(wrong) if wrong else "right"
    if figures["device"] != "cpu" and paths.get("staged_batches_used", 0) < BATCHES - 1:
        verdict += " (staged inputs not used: the staged path checked nothing)"
    return verdict


def table(figures: dict[str, Any]) -> str:
    lines = [
        "| model | answers | alone b=64 rows/s | worker path b=64 rows/s "
        "| staged ahead b=64 rows/s | c=1 infer/s | c=1 p50 ms | c=1 GPU util | c=64 infer/s "
        "| c=64 p50 ms | c=64 mean batch | c=64 GPU util | gRPC c=64 infer/s | gRPC c=64 p50 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, row in figures["models"].items():
        cells = [model, answers(figures, model)]
        cells += [cell(row[k], ",.0f") for k in ("alone", "worker_path", "staged_path")]
        for level in LEVELS:
            run = figures["served"].get(f"{model} c={level}", {})
            if "error" in run or not run:
                cells += [run.get("error", "-"), "-", "-"] + (["-"] if level > 1 else [])
                continue
            cells += [cell(run["throughput"], ",.0f"), cell(run["p50_ms"], ".2f")]
            cells += [cell(run["batch"], ".1f")] if level > 1 else []
            cells.append(cell(run["gpu_util"], ".0%"))
        grpc_run = figures["served"].get(f"{model} grpc", {})
        cells += [cell(grpc_run.get("throughput"), ",.0f"), cell(grpc_run.get("p50_ms"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"mlp at c={GATEWAY_LEVEL}, gateway processes on the ports (--gateways):", ""]
    lines += ["| gateways | HTTP infer/s | HTTP p50 ms | gRPC infer/s | gRPC p50 ms |"]
    lines += ["|---|---|---|---|---|"]
    counts = sorted(
        {int(k.split()[0].split("=")[1]) for k in figures["served"] if k.startswith("gateways=")}
    )
    for count in counts:
        runs = [figures["served"].get(f"gateways={count} {p}", {}) for p in ("http", "grpc")]
        cells = [str(count)]
        for run in runs:
            cells += [cell(run.get("throughput"), ",.0f"), cell(run.get("p50_ms"), ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny, on the CPU")
    parser.add_argument(
        "--seconds", dest="measure_s", type=float, default=3.0, help="per model-alone figure"
    )
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT") or None)
    args = parser.parse_args()
    started_s = time.monotonic()
    if args.cpu_dry_run:
        device, wide, measure_s = torch.device("cpu"), DRY_WIDE, DRY_MEASURE_S
    elif torch.cuda.is_available():
        device, wide, measure_s = torch.device("cuda", 0), WIDE, args.measure_s
    else:
        raise SystemExit("no CUDA device: run on a machine with a GPU, or with --cpu-dry-run")
    os.environ.update(DRY_BENCH_ENV if args.cpu_dry_run else BENCH_ENV)
    repo = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "models"
    try:
        widths = repository(repo, wide, device)
        figures: dict[str, Any] = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "wide": asdict(wide),
            "models": {},
            "answers": {},
        }
        for model, width in widths.items():
            errors = unless_it_fails(batch_path_errors, repo / model, width, BATCH, device)
            figures["answers"][model] = errors
            print(f"{model} answers, relative to the model's: {errors}", flush=True)
            figures["models"][model] = {
                "alone": alone(repo / model, width, device, measure_s),
                "worker_path": worker_path(repo / model, width, device, measure_s),
                "staged_path": unless_it_fails(staged_path, repo / model, width, device, measure_s),
            }
            print(f"{model}: {figures['models'][model]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the served instances load in a process of their own
        gpus = open_nvml(cuda_gpu_uuids())
        try:
            gateways = max(2, cores_available() // 4)
            grpc_s = DRY_GRPC_S if args.cpu_dry_run else GRPC_S
            figures["served"] = served(repo, widths, device, gpus, gateways, grpc_s)
        finally:
            if gpus is not None:
                gpus.close()
    finally:
        shutil.rmtree(repo.parent, ignore_errors=True)
    figures["seconds"] = round(time.monotonic() - started_s, 1)
    report = f"{figures['device']}, torch {figures['torch']}, {figures['seconds']} s\n\n"
    report += table(figures)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(figures, indent=2) + "\n")
        (args.out / "gpu_check.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
