"""The GPU check's answers: what each path it times answers, against the model's own forward.

A figure counts only for a path whose answers are the model's. The worker path and the staged
path each run batches of distinct rows back to back, the staged one with each next batch's
inputs copied while the lane computes the current one (where reusing pinned buffers or
device memory too early would show), and every batch's answers are compared once all have
run (where answers that share memory with a later batch would show). The served check sends
one request of a few rows over HTTP.

Each figure is the largest difference from the model's forward, over the largest magnitude
of its answers (at least 1): 0 when the path ran the same kernels on the same rows.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from sluice.shared.errors import SluiceError
from sluice.shared.model_config import ModelSpec, load_model_config
from sluice.shared.protocol import Request, Tensor
from sluice.workers.backends import load_function
from sluice.workers.devices.cuda_staging import CudaStaging, Staged
from sluice.workers.devices.stage_ahead import StageAhead
from sluice.workers.instances.model_instance import Batch
from sluice.workers.instances.stacked import StackedInstance, TensorFunction

#: the largest relative difference that still counts as the model's answer (FP32 kernels
#: picked for another batch size may sum in another order).
TOLERANCE = 1e-4
BATCHES = 4
SERVED_ROWS = 4
#: how long one served inference may take.
INFER_TIMEOUT_S = 60


def batch_path_errors(
    model_dir: Path, width: int, batch: int, device: torch.device
) -> dict[str, float]:
    """The worker path's and the staged path's difference from the model, BATCHES batches each."""
    spec, stacked, staging = instance(model_dir, device)
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randn(batch, width, generator=generator) for _ in range(BATCHES)]
    batches = [one_row_requests(f"b{b}", r) for b, r in enumerate(rows)]
    sizes = [1] * batch

    def run(requests: Sequence[Request], staged: Staged | None = None) -> Sequence[object]:
        results, _ = stacked.run(Batch(requests, sizes, staging=staging, staged=staged))
        return results

    plain = [run(requests) for requests in batches]
    ahead = StageAhead(spec, device)
    staged: list[Sequence[object]] = []
    with ThreadPoolExecutor(1) as lane:
        running = lane.submit(run, batches[0])
        for requests in batches[1:]:
            ahead.stage(requests)  # while the lane computes the batch before
            staged.append(running.result())
            running = lane.submit(run, requests, ahead.take(requests))
        staged.append(running.result())
    expected = [forward(stacked.function, r, device) for r in rows]
    return {
        "worker_path": max(_error(a, e) for a, e in zip(plain, expected, strict=True)),
        "staged_path": max(_error(a, e) for a, e in zip(staged, expected, strict=True)),
        "staged_batches_used": ahead.used,
    }


def served_error(url: str, model: str, model_dir: Path, width: int, device: torch.device) -> float:
    """One request of SERVED_ROWS rows through the gateway, against the model run here."""
    rows = torch.randn(SERVED_ROWS, width, generator=torch.Generator().manual_seed(2))
    body = {
        "inputs": [
            {
                "name": "INPUT__0",
                "shape": list(rows.shape),
                "datatype": "FP32",
                "data": rows.reshape(-1).tolist(),
            }
        ]
    }
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=INFER_TIMEOUT_S) as response:
        (output,) = json.loads(response.read())["outputs"]
    answer = np.asarray(output["data"], dtype=np.float32).reshape(output["shape"])
    spec = load_model_config(model_dir)
    expected = forward(load_function(spec, model_dir, 1, device, 0), rows, device)
    return _relative(answer, expected)


def forward(infer: TensorFunction, rows: torch.Tensor, device: torch.device) -> np.ndarray:
    """The model's own answer for `rows`, its inputs and outputs moved by plain copies."""
    with torch.inference_mode():
        outputs = infer({"INPUT__0": rows.to(device)})
    return outputs["OUTPUT__0"].cpu().numpy()


def instance(
    model_dir: Path, device: torch.device
) -> tuple[ModelSpec, StackedInstance, CudaStaging | None]:
    """The model's spec, one loaded instance on `device`, and its staging on a GPU."""
    spec = load_model_config(model_dir)
    stacked = StackedInstance(spec, load_function(spec, model_dir, 1, device, 0), device)
    return spec, stacked, CudaStaging(device) if device.type == "cuda" else None


def one_row_requests(prefix: str, rows: torch.Tensor) -> list[Request]:
    """A request per row of `rows`, ids `prefix` + its row."""
    return [
        Request(
            f"{prefix}r{i}",
            1,
            0,
            "check",
            [Tensor("INPUT__0", "FP32", (1, rows.shape[1]), rows[i : i + 1].numpy().tobytes())],
        )
        for i in range(rows.shape[0])
    ]


def _error(results: Sequence[object], expected: np.ndarray) -> float:
    """One batch's answers (one row per request) against the model's rows."""
    answers = []
    for result in results:
        if isinstance(result, SluiceError):
            return float("inf")
        (tensor,) = result  # type: ignore[misc]
        answers.append(np.frombuffer(tensor.data, dtype=np.float32).reshape(tensor.shape))
    return _relative(np.concatenate(answers), expected)


def _relative(answer: np.ndarray, expected: np.ndarray) -> float:
    if answer.shape != expected.shape:
        return float("inf")
    scale = max(1.0, float(np.abs(expected).max()))
    return float(np.abs(answer - expected).max()) / scale
