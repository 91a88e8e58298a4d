"""The instance of every model that computes a stacked batch: stack the inputs, run, cut the
outputs per request.

A plain tensor function (TorchScript, ONNX, TF, OpenVINO, FIL, TensorRT, .pt2, a sluice
`class Model`) takes the batch's named inputs stacked along the batch dim and returns named
outputs. Inputs are stacked with a single `np.concatenate` per input (the only copy on the way
in); outputs go back as views into the model's own output buffer, cut at each request's rows.
On a CUDA instance the inputs are stacked into its pinned buffers and the outputs come back
through its stream instead (`sluice.workers.devices.cuda_staging`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from sluice.shared.datatypes import (
    NUMPY_DTYPE,
    deserialize_bytes_elements,
    serialize_bytes_elements,
)
from sluice.shared.errors import ModelExecutionError
from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import Request, Tensor
from sluice.workers.devices.cuda_staging import CudaStaging, stack_into
from sluice.workers.instances.model_instance import (
    Batch,
    BatchOutputs,
    BatchTiming,
    Capabilities,
    GenerativeModel,
    Responses,
)

#: a model that computes a stacked batch: named input tensors (torch tensors on the model's
#: device; BYTES: numpy object arrays) to named outputs (torch tensors or numpy arrays).
TensorFunction = Callable[[dict[str, Any]], dict[str, Any]]

_TORCH_DTYPE_FOR_BF16 = torch.bfloat16
#: the torch dtype of each fixed-size datatype, to view a staged input's bytes as.
_TORCH_DTYPE = {
    name: _TORCH_DTYPE_FOR_BF16 if name == "BF16" else torch.from_numpy(np.empty(0, dt)).dtype
    for name, dt in NUMPY_DTYPE.items()
    if name != "BYTES"
}


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


class StackedInstance:
    """A tensor function on its device: collate the batch, call it, split its outputs."""

    capabilities = Capabilities()

    def __init__(self, spec: ModelSpec, function: TensorFunction, device: torch.device) -> None:
        self.spec = spec
        #: the backend's loaded model.
        self.function = function
        self.device = device

    def run(self, batch: Batch) -> BatchOutputs:
        """With the lane's CUDA `staging`, the model runs on its stream and the infer phase
        ends with the outputs in host memory (the batch's one synchronize)."""
        spec, requests, staging, staged = self.spec, batch.requests, batch.staging, batch.staged
        timing = BatchTiming()
        t0_ns = time.perf_counter_ns()
        try:
            inputs = (
                collate(spec, requests, self.device, staging) if staged is None else staged.inputs
            )
        finally:
            batch.stacked()
        t1_ns = time.perf_counter_ns()
        with torch.inference_mode():
            if staging is not None:
                with torch.cuda.stream(staging.stream):
                    if staged is not None:
                        staged.used_on(staging.stream)
                    outputs = staging.to_host(self.function(inputs))
            else:
                outputs = self.function(inputs)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        t2_ns = time.perf_counter_ns()
        results = split(spec, requests, batch.sizes, outputs)
        t3_ns = time.perf_counter_ns()
        timing.input_ns, timing.infer_ns, timing.output_ns = (
            t1_ns - t0_ns,
            t2_ns - t1_ns,
            t3_ns - t2_ns,
        )
        return results, timing

    def generative_model(self, responses: Responses) -> GenerativeModel | None:
        return None

    def close(self) -> None:
        """Nothing to let go: the function goes with the instance."""
