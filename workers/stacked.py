"""One batch through one model instance: stack the inputs, run, cut the outputs per request.

Inputs are stacked with a single `np.concatenate` per input (the only copy on the way in);
outputs go back as views into the model's own output buffer, cut at each request's rows. On a
CUDA instance the inputs are stacked into its pinned buffers and the outputs come back through
its stream instead (`sluice.workers.cuda_staging`). A Triton Python model takes the requests
unstacked instead and answers each one itself, possibly with an error of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sluice.shared.datatypes import (
    NUMPY_DTYPE,
    deserialize_bytes_elements,
    serialize_bytes_elements,
)
from sluice.shared.errors import ModelExecutionError, SluiceError
from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import Request, Tensor
from sluice.workers.backends import Infer
from sluice.workers.cuda_staging import CudaStaging, Staged, stack_into
from sluice.workers.python_backend.instance import Answered, TritonInstance

_TORCH_DTYPE_FOR_BF16 = torch.bfloat16
#: the torch dtype of each fixed-size datatype, to view a staged input's bytes as.
_TORCH_DTYPE = {
    name: _TORCH_DTYPE_FOR_BF16 if name == "BF16" else torch.from_numpy(np.empty(0, dt)).dtype
    for name, dt in NUMPY_DTYPE.items()
    if name != "BYTES"
}


@dataclass(slots=True)
class BatchTiming:
    """Nanoseconds spent in each phase, as Triton's compute_input / infer / output."""

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0


def _parts(requests: Sequence[Request], name: str, datatype: str) -> list[np.ndarray]:
    """Each request's `name` input as an array over its wire bytes (BYTES: decoded)."""
    parts = []
    for request in requests:
        tensor = next(t for t in request.inputs if t.name == name)
        if datatype == "BYTES":
            array = np.empty(len(deserialize_bytes_elements(tensor.data)), dtype=object)
            array[:] = deserialize_bytes_elements(tensor.data)
            parts.append(array.reshape(tensor.shape))
        else:
            dtype = NUMPY_DTYPE[datatype]
            parts.append(np.frombuffer(tensor.data, dtype=dtype).reshape(tensor.shape))
    return parts


def _stack(requests: Sequence[Request], name: str, datatype: str) -> np.ndarray:
    parts = _parts(requests, name, datatype)
    if len(parts) == 1 and datatype == "BYTES":
        return parts[0]
    return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()


def _model_shape(
    shape: tuple[int, ...], spec_reshape: tuple[int, ...] | None, batched: bool
) -> tuple[int, ...]:
    if spec_reshape is None:
        return shape
    return (shape[0], *spec_reshape) if batched else spec_reshape


def _to_model_input(
    array: np.ndarray,
    datatype: str,
    spec_reshape: tuple[int, ...] | None,
    batched: bool,
    device: torch.device,
) -> object:
    if spec_reshape is not None:
        array = array.reshape(_model_shape(array.shape, spec_reshape, batched))
    if datatype == "BYTES":
        return array
    tensor = torch.from_numpy(array)
    if datatype == "BF16":
        tensor = tensor.view(_TORCH_DTYPE_FOR_BF16)
    return tensor.to(device, non_blocking=True)


def collate(
    spec: ModelSpec,
    requests: Sequence[Request],
    device: torch.device,
    staging: CudaStaging | None = None,
) -> dict[str, object]:
    """The model's named inputs for `requests` stacked along the batch dim (through `staging`'s
    pinned buffers and stream when given, BYTES aside)."""
    batched = spec.max_batch_size > 0
    inputs: dict[str, object] = {}
    for io in spec.inputs:
        if not any(t.name == io.name for t in requests[0].inputs):
            continue  # an optional input the requests left out
        if staging is not None and io.datatype != "BYTES":
            parts = _parts(requests, io.name, io.datatype)
            raw, shape = stack_into(staging.buffers, io.name, parts, NUMPY_DTYPE[io.datatype])
            shape = _model_shape(shape, io.reshape, batched)
            inputs[io.name] = staging.to_device(raw, _TORCH_DTYPE[io.datatype], shape)
            continue
        array = _stack(requests, io.name, io.datatype)
        inputs[io.name] = _to_model_input(array, io.datatype, io.reshape, batched, device)
    return inputs


def _to_numpy(value: object, datatype: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.dtype == torch.bfloat16:
            value = value.view(torch.int16)
        return value.cpu().contiguous().numpy()
    if datatype == "BYTES":
        array = np.empty(len(value), dtype=object) if isinstance(value, list) else None
        if array is not None:
            array[:] = value
            return array
    return np.ascontiguousarray(np.asarray(value))


def output_array(value: object, datatype: str) -> np.ndarray:
    """A model's output (torch tensor, numpy array, list) as a numpy array of its datatype."""
    array = _to_numpy(value, datatype)
    if datatype not in ("BYTES", "BF16") and array.dtype != NUMPY_DTYPE[datatype]:
        array = array.astype(NUMPY_DTYPE[datatype])
    return array


def output_tensor(name: str, datatype: str, value: object) -> Tensor:
    """One whole output as a wire tensor (a streamed response's, not cut per request)."""
    return _tensor(name, datatype, output_array(value, datatype))


def split(
    spec: ModelSpec, requests: Sequence[Request], sizes: Sequence[int], outputs: dict[str, object]
) -> list[list[Tensor]]:
    """Per request, its requested outputs as views into the batch output."""
    total = sum(sizes)
    batched = spec.max_batch_size > 0
    per_request: list[list[Tensor]] = [[] for _ in requests]
    for io in spec.outputs:
        wanted = [r.outputs is None or io.name in r.outputs for r in requests]
        if not any(wanted):
            continue
        if io.name not in outputs:
            raise ModelExecutionError(f"model '{spec.name}' did not return output '{io.name}'")
        array = output_array(outputs[io.name], io.datatype)
        if not batched:
            array = array.reshape(_client_shape(io.dims, array.size)) if io.reshape else array
            per_request[0].append(_tensor(io.name, io.datatype, array))
            continue
        if array.ndim == 0 or array.shape[0] != total:
            raise ModelExecutionError(
                f"model '{spec.name}' returned {array.shape[0] if array.ndim else 0} rows of "
                f"'{io.name}' for a batch of {total}"
            )
        if io.reshape is not None:
            array = array.reshape((total, *_client_shape(io.dims, array.size // max(total, 1))))
        offset = 0
        for index, size in enumerate(sizes):
            if wanted[index]:
                per_request[index].append(
                    _tensor(io.name, io.datatype, array[offset : offset + size])
                )
            offset += size
    return per_request


def _client_shape(dims: tuple[int, ...], count: int) -> tuple[int, ...]:
    known = 1
    for d in dims:
        known *= d if d > 0 else 1
    return tuple(d if d != -1 else count // max(known, 1) for d in dims)


def _tensor(name: str, datatype: str, array: np.ndarray) -> Tensor:
    if datatype == "BYTES":
        data: bytes | memoryview = serialize_bytes_elements(array.reshape(-1).tolist())
    else:
        data = array.reshape(-1).view(np.uint8).data
    return Tensor(name, datatype, tuple(array.shape), data)


#: each request's output tensors (or the error that answers it), and the batch's phase timings.
BatchOutputs = tuple[Sequence[list[Tensor] | Answered | SluiceError], BatchTiming]


def adopt_torch_threads() -> None:
    """Give the calling thread (an instance's, or the event loop's: both run batches) the
    process's torch thread count.

    OpenMP keeps its thread count per thread, and torch applies its own count to a thread
    other than the one that set it only on the first operator large enough to split. Until
    then MKL runs every matrix product of small batches on a team of all the cores, whatever
    INTRA_OP_THREAD_COUNT says, and the team's spare thread spins between products.
    """
    torch.set_num_threads(torch.get_num_threads())


def run_batch(
    spec: ModelSpec,
    infer: Infer,
    requests: Sequence[Request],
    sizes: Sequence[int],
    device: torch.device,
    stacked: Callable[[], None] = lambda: None,
    staging: CudaStaging | None = None,
    staged: Staged | None = None,
) -> BatchOutputs:
    """Run one batch on one instance; called in the instance's thread. `stacked` is called
    once the inputs are stacked (or failed to stack), just before the model runs; inputs
    `staged` ahead for these requests are used as they are. With the instance's CUDA
    `staging`, the model runs on its stream and the infer phase ends with the outputs in host
    memory (the batch's one synchronize)."""
    if isinstance(infer, TritonInstance):
        return _run_requests(infer, requests, stacked)
    timing = BatchTiming()
    t0 = time.perf_counter_ns()
    try:
        inputs = collate(spec, requests, device, staging) if staged is None else staged.inputs
    finally:
        stacked()
    t1 = time.perf_counter_ns()
    with torch.inference_mode():
        if staging is not None:
            with torch.cuda.stream(staging.stream):
                if staged is not None:
                    staged.used_on(staging.stream)
                outputs = staging.to_host(infer(inputs))
        else:
            outputs = infer(inputs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    t2 = time.perf_counter_ns()
    results = split(spec, requests, sizes, outputs)
    t3 = time.perf_counter_ns()
    timing.input_ns, timing.infer_ns, timing.output_ns = t1 - t0, t2 - t1, t3 - t2
    return results, timing


def _run_requests(
    instance: TritonInstance, requests: Sequence[Request], stacked: Callable[[], None]
) -> BatchOutputs:
    """A Triton Python model's run: its `execute` counts as the inference, outputs and all."""
    timing = BatchTiming()
    t0 = time.perf_counter_ns()
    handed: list[int] = []

    def handed_over() -> None:
        handed.append(time.perf_counter_ns())
        stacked()

    answers = instance.run(requests, handed_over)
    t2 = time.perf_counter_ns()
    t1 = handed[0] if handed else t0
    timing.input_ns, timing.infer_ns = t1 - t0, t2 - t1
    return answers, timing
