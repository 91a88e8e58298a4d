"""Triton's model warm-up (`model_warmup [...]`): sample requests each instance runs after it
loads and before its model is ready, so that the first client requests do not pay for lazy
initialisation (torch's first call, ONNX Runtime's arena, TensorFlow's graph).

Each sample names its inputs (`data_type`, `dims` without the batch dim, and `zero_data`,
`random_data` or `input_data_file`: raw row-major bytes in the model's `warmup/` directory,
BYTES as 4-byte lengths and bytes) and runs `max(count, 1)` times, in order, as `batch_size`
requests of one row in one call (`batch_size` 0: not run). The first sample that fails stops
the load with Triton's reason, `failed to run warmup sample '<name>': <its errors>`, and the
model is not served. Answers are dropped; a decoupled model's are taken by a sink of their own
and the run ends once every request has had its final response (or DECOUPLED_WAIT_S passed,
a failure). Iterative (generative) models are not warmed up.
Each run counts in the model's statistics as Triton counts it: `batch_size` inferences, one
execution of that batch size.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from sluice.shared.datatypes import NUMPY_DTYPE, config_to_wire, serialize_bytes_elements
from sluice.shared.errors import ModelConfigError, SluiceError
from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import Request, ResponseParameter, Tensor
from sluice.shared.stats import BatchStats
from sluice.workers.instances.model_instance import Answered, Batch, ModelInstance

#: the folder of a model's warm-up data files.
WARMUP_DIR = "warmup"
#: how long a decoupled model's warm-up run may take to send every final response.
DECOUPLED_WAIT_S = 60.0


class DropResponses:
    """A decoupled warm-up run's responses: dropped, but for their errors and the final ones,
    which end the run."""

    def __init__(self, requests: int) -> None:
        self._open = requests
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        if not requests:
            self._done.set()

    def send_tensors(
        self,
        request: Request,
        tensors: Sequence[Tensor],
        error: SluiceError | None = None,
        final: bool = False,
        parameters: dict[str, ResponseParameter] | None = None,
    ) -> None:
        if error is not None:
            self._errors.append(error.message)
        if final:
            self._close()

    def end(self, request: Request, error: SluiceError) -> bool:
        self._errors.append(error.message)
        self._close()
        return True

    def is_cancelled(self, request_id: str) -> bool:
        return False

    def _close(self) -> None:
        with self._lock:
            self._open -= 1
            if self._open <= 0:
                self._done.set()

    def wait(self, timeout_s: float) -> list[str]:
        """The run's errors once every request has ended (one more if they did not in time)."""
        if not self._done.wait(timeout_s):
            return [*self._errors, f"no final response within {timeout_s:g} s"]
        return self._errors


def warm_up(
    spec: ModelSpec, model_dir: Path, version: int, instance: ModelInstance
) -> list[str | int]:
    """Run the config's warm-up samples on `instance` (ModelConfigError: one failed); the
    statistics of its runs (shared/stats.py increments)."""
    samples = spec.config_json.get("model_warmup") or []
    increments: list[str | int] = []
    if not samples or spec.config.iterative_sequence:
        return increments
    for sample in samples:
        name = str(sample.get("name", ""))
        rows = int(sample.get("batch_size") or 0)
        if not rows:
            continue
        inputs = [
            _tensor(spec, model_dir, input_name, setting)
            for input_name, setting in (sample.get("inputs") or {}).items()
        ]
        for _ in range(max(1, int(sample.get("count") or 0))):
            increments += _run(instance, version, name, inputs, rows, spec.config.decoupled)
    return increments


def _run(
    instance: ModelInstance,
    version: int,
    name: str,
    inputs: list[Tensor],
    rows: int,
    decoupled: bool,
) -> list[str | int]:
    """One run of a sample, and its statistics; ModelConfigError with its requests' errors."""
    started_ns = time.time_ns()
    requests = [
        Request(f"warmup:{name}:{row}", version, started_ns, "", list(inputs))
        for row in range(rows)
    ]
    sink = DropResponses(len(requests)) if decoupled else None
    try:
        answers, timing = instance.run(Batch(requests, [1] * rows, responses=sink))
    except Exception as exc:  # the model's own failure
        errors = [f"{type(exc).__name__}: {exc}"]
    else:
        errors = []
        for answer in answers:
            error = answer.error if isinstance(answer, Answered) else answer
            if isinstance(error, SluiceError):
                errors.append(error.message)
        if sink is not None and not errors:
            errors = sink.wait(DECOUPLED_WAIT_S)
    if errors:
        reasons = "; ".join(dict.fromkeys(errors))  # each reason once, in order
        raise ModelConfigError(f"failed to run warmup sample '{name}': {reasons}")
    finished_ns = time.time_ns()
    stats = BatchStats(version, rows, finished_ns // 1_000_000, queue_samples_ns=[0] * rows)
    stats.input_ns, stats.infer_ns, stats.output_ns = (
        timing.input_ns,
        timing.infer_ns,
        timing.output_ns,
    )
    stats.settle([started_ns] * rows, [False] * rows, finished_ns)
    return stats.increments()


def _tensor(spec: ModelSpec, model_dir: Path, name: str, setting: dict[str, Any]) -> Tensor:
    """One input of a sample, with its batch dim of one where the model batches."""
    datatype = config_to_wire(str(setting.get("data_type", "TYPE_FP32")))
    dims = tuple(int(d) for d in setting.get("dims") or ())
    if any(d < 0 for d in dims):
        raise ModelConfigError(
            f"warmup setting expects all variable-size dimensions are specified for input '{name}'"
        )
    shape = ((1,) if spec.max_batch_size > 0 else ()) + dims
    count = int(np.prod(shape, dtype=np.int64))
    if setting.get("input_data_file"):
        data = _data_file(model_dir, str(setting["input_data_file"]))
    elif datatype == "BYTES":  # zero or random: empty strings, as in Triton
        data = serialize_bytes_elements([b""] * count)
    elif setting.get("random_data"):
        data = _random(datatype, count)
    else:
        data = np.zeros(count, NUMPY_DTYPE[datatype]).tobytes()
    return Tensor(name, datatype, shape, data)


def _random(datatype: str, count: int) -> bytes:
    dtype = np.dtype(NUMPY_DTYPE[datatype])
    rng = np.random.default_rng()
    if dtype.kind == "f":
        return rng.random(count).astype(dtype).tobytes()
    if dtype.kind == "b":
        return rng.integers(0, 2, count).astype(dtype).tobytes()
    return rng.integers(0, 100, count).astype(dtype).tobytes()


def _data_file(model_dir: Path, file_name: str) -> bytes:
    """A sample's data file: in the model's warmup/ folder, never outside it."""
    folder = (model_dir / WARMUP_DIR).resolve()
    path = (folder / file_name).resolve()
    if not path.is_relative_to(folder) or not path.is_file():
        raise ModelConfigError(
            f"warmup input data file '{file_name}' is not a file in {WARMUP_DIR}/ of the model"
        )
    return path.read_bytes()
