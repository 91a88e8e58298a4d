"""TensorRT engines (`platform: "tensorrt_plan"` or `backend: "tensorrt"`), on an NVIDIA GPU.

The version folder's `model.plan` is a serialized engine (built for the GPU and TensorRT
version that run it). Config names are the engine's IO tensor names; a config that leaves its
inputs or outputs out is completed from the engine (`max_batch_size` from the first
optimization profile's largest batch). Each instance deserializes the engine onto its GPU and
runs one execution context on the current CUDA stream, its inputs and outputs torch CUDA
tensors bound by address. Where there is no CUDA device or no tensorrt package the model is
UNAVAILABLE before this module is imported (workers/backends/__init__.py). Shape tensors,
several profiles and non-linear formats are not handled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tensorrt as trt
import torch
from sluice.shared.datatypes import wire_to_config
from sluice.shared.errors import ModelConfigError, ModelExecutionError
from sluice.shared.model_config import ModelSpec, TensorSpec
from sluice.workers.backends import complete_batching, newest_model_file
from sluice.workers.instances.stacked import TensorFunction
from tritonclient.grpc.model_config_pb2 import DataType, ModelConfig

#: TensorRT's data types (by name) as Triton's config types and torch's dtypes.
_TYPES: dict[str, tuple[str, torch.dtype]] = {
    "FLOAT": ("TYPE_FP32", torch.float32),
    "HALF": ("TYPE_FP16", torch.float16),
    "BF16": ("TYPE_BF16", torch.bfloat16),
    "INT8": ("TYPE_INT8", torch.int8),
    "UINT8": ("TYPE_UINT8", torch.uint8),
    "INT32": ("TYPE_INT32", torch.int32),
    "INT64": ("TYPE_INT64", torch.int64),
    "BOOL": ("TYPE_BOOL", torch.bool),
}
#: one runtime for every engine: it must outlive them.
_RUNTIME = trt.Runtime(trt.Logger(trt.Logger.WARNING))


def load_instance(
    spec: ModelSpec, model_dir: Path, version: int, device: torch.device, index: int
) -> TensorFunction:
    """The version's engine on the instance's GPU, its config checked against the engine."""
    if device.type != "cuda" or spec.instance_kind == "KIND_CPU":
        raise ModelConfigError(
            f"unable to load model '{spec.name}', TensorRT backend supports only GPU device"
        )
    with torch.cuda.device(device):
        engine = _engine(model_dir / str(version) / spec.model_filename)
        context = engine.create_execution_context()
    tensors = _io_tensors(engine)
    for label, ios in (("input", spec.inputs), ("output", spec.outputs)):
        for io in ios:
            _check_tensor(spec, engine, tensors, label, io)
    outputs = [name for name, is_input in tensors.items() if not is_input]
    wanted = {io.name for io in spec.outputs}

    def infer(inputs: dict[str, Any]) -> dict[str, Any]:
        stream = torch.cuda.current_stream(device)
        bound = {name: tensor.contiguous() for name, tensor in inputs.items()}
        for name, tensor in bound.items():
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        results = {}
        for name in outputs:
            dtype = _TYPES[engine.get_tensor_dtype(name).name][1]
            shape = tuple(context.get_tensor_shape(name))
            results[name] = torch.empty(shape, dtype=dtype, device=device)
            context.set_tensor_address(name, results[name].data_ptr())
        if not context.execute_async_v3(stream.cuda_stream):
            raise ModelExecutionError(f"model '{spec.name}': TensorRT failed to run the batch")
        return {name: tensor for name, tensor in results.items() if name in wanted}

    return infer


def complete_config(cfg: ModelConfig, model_dir: Path) -> None:
    """Triton's auto-complete: the engine's largest batch (first profile) as `max_batch_size`
    when none is set, dynamic batching when it is above 1, and the inputs or outputs that
    config.pbtxt leaves out, from the engine's IO tensors."""
    if cfg.input and cfg.output:
        return
    path = newest_model_file(model_dir, cfg.default_model_filename or "model.plan")
    if path is None:
        return  # the scan reports the missing file
    engine = _engine(path)
    tensors = _io_tensors(engine)
    largest = min(
        (_largest_batch(engine, name) for name, is_input in tensors.items() if is_input),
        default=0,
    )
    if cfg.max_batch_size == 0:
        cfg.max_batch_size = largest
    elif cfg.max_batch_size > largest:
        raise ModelConfigError(
            f"autofill failed for model '{cfg.name}': configuration specified max-batch "
            f"{cfg.max_batch_size} but TensorRT engine only supports max-batch {largest}"
        )
    if cfg.max_batch_size > 0:
        complete_batching(cfg)
    for label, ios in (("input", cfg.input), ("output", cfg.output)):
        if not ios:
            for name in (n for n, is_input in tensors.items() if is_input == (label == "input")):
                _fill_tensor(ios.add(), engine, name, cfg.max_batch_size, path)


def _fill_tensor(io: Any, engine: Any, name: str, max_batch_size: int, path: Path) -> None:
    io.name = name
    io.data_type = DataType.Value(_config_type(engine, name, path))
    dims = list(engine.get_tensor_shape(name))[1 if max_batch_size > 0 else 0 :]
    io.dims.extend(dims or [1])
    if not dims:
        io.reshape.SetInParent()


def _largest_batch(engine: Any, name: str) -> int:
    shape = list(engine.get_tensor_shape(name))
    if not shape:
        return 0
    if shape[0] != -1:
        return int(shape[0])
    return int(engine.get_tensor_profile_shape(name, 0)[2][0])


def _check_tensor(
    spec: ModelSpec, engine: Any, tensors: dict[str, bool], label: str, io: TensorSpec
) -> None:
    name = io.name
    allowed = sorted(n for n, is_input in tensors.items() if is_input == (label == "input"))
    if name not in allowed:
        raise ModelConfigError(
            f"unexpected inference {label} '{name}', allowed {label}s are: " + ", ".join(allowed)
        )
    expected = wire_to_config(io.datatype)
    provided = _TYPES.get(engine.get_tensor_dtype(name).name, ("TYPE_INVALID",))[0]
    if expected != provided:
        raise ModelConfigError(
            f"unable to load model '{spec.name}', configuration expects datatype {expected} "
            f"for {label} '{name}', model provides {provided}"
        )


def _config_type(engine: Any, name: str, path: Path) -> str:
    kind = engine.get_tensor_dtype(name).name
    if kind not in _TYPES:
        raise ModelConfigError(f"{path}: '{name}' is of type {kind}, which has no Triton type")
    return _TYPES[kind][0]


def _io_tensors(engine: Any) -> dict[str, bool]:
    """The engine's IO tensor names, in order, each with whether it is an input."""
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    return {n: engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}


def _engine(path: Path) -> Any:
    try:
        plan = path.read_bytes()
    except OSError as exc:
        raise ModelConfigError(f"{path}: cannot read: {exc}") from exc
    engine = _RUNTIME.deserialize_cuda_engine(plan)
    if engine is None:
        raise ModelConfigError(
            f"{path}: not a TensorRT engine this GPU and TensorRT version can deserialize"
        )
    return engine
