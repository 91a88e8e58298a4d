"""ONNX Runtime models (`platform: "onnxruntime_onnx"` or `backend: "onnxruntime"`), as Triton's
onnxruntime backend serves them.

The version folder's `model.onnx` is a file, or a directory holding `model.onnx` beside its
external weights. Config names are the graph's input and output names, verbatim; a config
that leaves its inputs or outputs out is completed from the graph (Triton's auto-complete).
The batch's inputs arrive as torch tensors in host memory and reach ONNX Runtime as numpy
views of them (no copy); the CUDA execution provider, when the instance may use a GPU and
one is present, copies them to the device itself.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from sluice.shared.datatypes import wire_to_config
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import ModelSpec, TensorSpec
from sluice.workers.backends import complete_batching, newest_model_file
from sluice.workers.instances.stacked import TensorFunction
from tritonclient.grpc.model_config_pb2 import DataType, ModelConfig

log = logging.getLogger(__name__)

#: ONNX Runtime's element types as Triton's config data types.
_CONFIG_TYPES = {
    "tensor(float)": "TYPE_FP32",
    "tensor(double)": "TYPE_FP64",
    "tensor(float16)": "TYPE_FP16",
    "tensor(bfloat16)": "TYPE_BF16",
    "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int64)": "TYPE_INT64",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32",
    "tensor(uint64)": "TYPE_UINT64",
    "tensor(bool)": "TYPE_BOOL",
    "tensor(string)": "TYPE_STRING",
}
#: `optimization { graph { level } }` as Triton maps it (unset and 0: every optimisation).
_GRAPH_LEVELS = {
    0: ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    -1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    2: ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}
_EXECUTION_MODES = {"0": ort.ExecutionMode.ORT_SEQUENTIAL, "1": ort.ExecutionMode.ORT_PARALLEL}
_BOOLEANS = {"1": True, "true": True, "0": False, "false": False}
_CUDA = "CUDAExecutionProvider"
_CPU = "CPUExecutionProvider"


def load_instance(
    spec: ModelSpec, model_dir: Path, version: int, device: torch.device, index: int
) -> TensorFunction:
    """A session of the version's model, its config checked against the graph."""
    path = _model_path(model_dir / str(version) / spec.model_filename)
    session = _session(path, session_options(spec, path), _providers(spec))
    graph_inputs = {i.name: i for i in session.get_inputs()}
    overridable = {i.name: i for i in session.get_overridable_initializers()}
    _check_inputs(spec, graph_inputs, overridable)
    graph_outputs = {o.name: o for o in session.get_outputs()}
    _check_outputs(spec, graph_outputs)
    scalar_inputs = {n for n, i in {**overridable, **graph_inputs}.items() if not i.shape}
    output_names = [o.name for o in spec.outputs]
    scalar_outputs = {o.name: o.dims for o in spec.outputs if not graph_outputs[o.name].shape}

    def infer(inputs: dict[str, Any]) -> dict[str, Any]:
        feed = {name: _feed(value, name in scalar_inputs) for name, value in inputs.items()}
        results = session.run(output_names, feed)
        outputs = dict(zip(output_names, results, strict=True))
        for name, dims in scalar_outputs.items():
            outputs[name] = outputs[name].reshape(dims)
        return outputs

    return infer


def complete_config(cfg: ModelConfig, model_dir: Path) -> None:
    """Triton's auto-complete: when config.pbtxt leaves its inputs or outputs out, fill them in
    from the graph, with `max_batch_size` (4 when the graph can batch and none is set) and
    dynamic batching (when it can batch more than one)."""
    if cfg.input and cfg.output:
        return
    found = newest_model_file(model_dir, cfg.default_model_filename or "model.onnx")
    if found is None:
        return  # the scan reports the missing file
    path = _model_path(found)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = _session(path, options, [_CPU])
    inputs, outputs = session.get_inputs(), session.get_outputs()
    _complete_batching(cfg, all(_batchable(t.shape) for t in [*inputs, *outputs]))
    if not cfg.input:
        for tensor in inputs:
            _fill_tensor(cfg.input.add(), tensor, cfg.max_batch_size, path)
    if not cfg.output:
        for tensor in outputs:
            _fill_tensor(cfg.output.add(), tensor, cfg.max_batch_size, path)


def _complete_batching(cfg: ModelConfig, can_batch: bool) -> None:
    if not can_batch:
        if cfg.max_batch_size != 0:
            raise ModelConfigError(
                f"autofill failed for model '{cfg.name}': model does not support batching while "
                "non-zero max_batch_size is specified"
            )
        return
    complete_batching(cfg)


def _fill_tensor(io: Any, tensor: Any, max_batch_size: int, path: Path) -> None:
    """One config input or output from a graph tensor: dims without the batch dim; a scalar
    as `dims: [1]` (with `reshape { shape: [] }` when batching)."""
    io.name = tensor.name
    io.data_type = DataType.Value(_config_type(tensor, path))
    dims = [_dim(d) for d in tensor.shape][1 if max_batch_size > 0 else 0 :]
    if dims:
        io.dims.extend(dims)
        return
    io.dims.append(1)
    if max_batch_size > 0:
        io.reshape.SetInParent()


def _config_type(tensor: Any, path: Path) -> str:
    try:
        return _CONFIG_TYPES[tensor.type]
    except KeyError:
        raise ModelConfigError(
            f"{path}: '{tensor.name}' is of type {tensor.type}, which has no Triton data type"
        ) from None


def _batchable(shape: list[Any]) -> bool:
    return bool(shape) and _dim(shape[0]) == -1


def _dim(value: Any) -> int:
    """A graph dimension: a number, or -1 for a symbolic or unknown one."""
    return value if isinstance(value, int) and value >= 0 else -1


def _model_path(path: Path) -> Path:
    """`model.onnx`, or `model.onnx/model.onnx` when it is a directory (external weights)."""
    return path / path.name if path.is_dir() else path


def _session(path: Path, options: Any, providers: list[Any]) -> Any:
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception classes, untyped
        raise ModelConfigError(f"{path}: cannot load ONNX model: {exc}") from exc


def _providers(spec: ModelSpec) -> list[Any]:
    """CUDA first when the instance kind allows a GPU and one is present, CPU always."""
    gpu_allowed = spec.instance_kind in ("KIND_GPU", "KIND_AUTO")
    if gpu_allowed and _CUDA in ort.get_available_providers() and torch.cuda.is_available():
        return [_CUDA, _CPU]
    if spec.instance_kind == "KIND_GPU":
        log.warning("model %r asks for KIND_GPU but ONNX Runtime has no GPU: CPU", spec.name)
    return [_CPU]


def session_options(spec: ModelSpec, path: Path) -> Any:
    """Triton's parameters for the session: thread counts, execution mode, memory arena and
    pattern, and the graph optimisation level."""
    options = ort.SessionOptions()
    params = spec.parameters
    if "intra_op_thread_count" in params:
        options.intra_op_num_threads = _count(params, "intra_op_thread_count", path)
    if "inter_op_thread_count" in params:
        options.inter_op_num_threads = _count(params, "inter_op_thread_count", path)
    if "execution_mode" in params:
        options.execution_mode = _choice(params, "execution_mode", _EXECUTION_MODES, path)
    if "enable_mem_arena" in params:
        options.enable_cpu_mem_arena = _choice(params, "enable_mem_arena", _BOOLEANS, path)
    if "enable_mem_pattern" in params:
        options.enable_mem_pattern = _choice(params, "enable_mem_pattern", _BOOLEANS, path)
    level = spec.config_json.get("optimization", {}).get("graph", {}).get("level", 0)
    if level not in _GRAPH_LEVELS:
        raise ModelConfigError(
            f"{path}: optimization.graph.level: {level} is none of {sorted(_GRAPH_LEVELS)}"
        )
    options.graph_optimization_level = _GRAPH_LEVELS[level]
    return options


def _count(params: dict[str, str], key: str, path: Path) -> int:
    value = params[key].strip()
    if not value.isdigit():
        raise ModelConfigError(f"{path}: parameters.{key}: '{value}' is not a count (0: all)")
    return int(value)


def _choice(params: dict[str, str], key: str, choices: dict[str, Any], path: Path) -> Any:
    value = params[key].strip().lower()
    if value not in choices:
        raise ModelConfigError(f"{path}: parameters.{key}: '{value}' is none of {list(choices)}")
    return choices[value]


def _check_inputs(spec: ModelSpec, graph: dict[str, Any], overridable: dict[str, Any]) -> None:
    """Triton's checks of the config's inputs against the graph's, with its messages."""
    if len(graph) != len(spec.inputs):
        raise _unable(
            spec, f"configuration expects {len(spec.inputs)} inputs, model provides {len(graph)}"
        )
    allowed = {**overridable, **graph}
    for io in spec.inputs:
        if io.name not in allowed:
            raise ModelConfigError(
                f"unexpected inference input '{io.name}', allowed inputs are: "
                + ", ".join(sorted(allowed))
            )
        if io.optional and spec.max_batch_size != 0:
            raise _unable(
                spec,
                f"optional input '{io.name}' is not supported for models that support batching",
            )
        _check_tensor(spec, "input", io, allowed[io.name])


def _check_outputs(spec: ModelSpec, graph: dict[str, Any]) -> None:
    """The config's outputs (a subset of the graph's) by name, type and shape."""
    for io in spec.outputs:
        if io.name not in graph:
            raise ModelConfigError(
                f"unexpected inference output '{io.name}', allowed outputs are: "
                + ", ".join(sorted(graph))
            )
        _check_tensor(spec, "output", io, graph[io.name])


def _check_tensor(spec: ModelSpec, label: str, io: TensorSpec, tensor: Any) -> None:
    name = io.name
    expected = wire_to_config(io.datatype)
    if expected == "TYPE_BF16":
        raise _unable(spec, f"{label} '{name}': BF16 tensors are not supported here")
    provided = _CONFIG_TYPES.get(tensor.type, tensor.type)
    if expected != provided:
        raise _unable(
            spec,
            f"configuration expects datatype {expected} for {label} '{name}', "
            f"model provides {provided}",
        )
    model_shape = [_dim(d) for d in tensor.shape]
    shape = list(io.reshape if io.reshape is not None else io.dims)
    if not model_shape:
        if any(d != 1 for d in shape):
            raise _unable(
                spec,
                f"scalar tensor '{name}', should only provide 1 in the model configuration when "
                f"the model doesn't support batching. Model configuration provided: {shape}.",
            )
        return
    if spec.max_batch_size > 0:
        if model_shape[0] != -1:
            raise ModelConfigError(
                f"model '{spec.name}', tensor '{name}': for the model to support batching the "
                "shape should have at least 1 dimension and the first dimension must be -1; "
                f"but shape expected by the model is {model_shape}"
            )
        model_shape = model_shape[1:]
    if len(model_shape) != len(shape) or any(
        m != -1 and m != c for m, c in zip(model_shape, shape, strict=True)
    ):
        batch = " (after the batch dimension)" if spec.max_batch_size > 0 else ""
        raise ModelConfigError(
            f"model '{spec.name}', tensor '{name}': the model expects shape {model_shape}"
            f"{batch} but the model configuration specifies {shape}"
        )


def _unable(spec: ModelSpec, reason: str) -> ModelConfigError:
    return ModelConfigError(f"unable to load model '{spec.name}', {reason}")


def _feed(value: Any, scalar: bool) -> Any:
    """A numpy view of a host tensor (BYTES: the strings ONNX Runtime takes)."""
    if isinstance(value, torch.Tensor):
        array = value.numpy()
    elif value.dtype == object:
        array = np.array([_text(v) for v in value.reshape(-1)], dtype=object).reshape(value.shape)
    else:
        array = value
    return array.reshape(()) if scalar else array


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
