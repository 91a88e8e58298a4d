"""OpenVINO models (`backend: "openvino"`), as Triton's openvino backend serves them, on CPU.

The version folder's `model.xml` (OpenVINO's IR, its weights in `model.bin` beside it), or any
file OpenVINO reads itself (`default_model_filename: "model.onnx"`). Config names are the
model's tensor names; a config that leaves its inputs or outputs out is completed from the
model (Triton's auto-complete: it batches when every tensor's layout has a batch dim). A
config data type that differs from the model's is converted by OpenVINO's pre/post-processing,
as Triton does. With `max_batch_size > 0` the inputs' first dim becomes a dynamic batch of
1..max_batch_size, so any batch the batcher forms runs as it is; ENABLE_BATCH_PADDING or
SKIP_OV_DYNAMIC_BATCHSIZE keep it fixed at max_batch_size, and smaller batches are padded
with zeros (Triton fixes it there always and refuses smaller batches unless padding is on).
Each instance compiles the model for CPU in f32 (bf16 only with HINT_BF16), and runs one
infer request: the inputs are numpy views of the stacked host tensors, the outputs copies
(the request reuses its output buffers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino.properties as props
import openvino.properties.hint as hints
import torch
from openvino.preprocess import PrePostProcessor
from sluice.shared.datatypes import wire_to_config
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import CONFIG_FILENAME, ModelSpec
from sluice.workers.backends import complete_batching, newest_model_file
from sluice.workers.backends.signal_stack import signal_stack_kept
from sluice.workers.instances.stacked import TensorFunction
from tritonclient.grpc.model_config_pb2 import DataType, ModelConfig

log = logging.getLogger(__name__)

#: the config data types Triton's openvino backend maps, as OpenVINO element types.
_ELEMENT_TYPES = {
    "TYPE_BOOL": ov.Type.boolean,
    "TYPE_UINT8": ov.Type.u8,
    "TYPE_UINT16": ov.Type.u16,
    "TYPE_UINT32": ov.Type.u32,
    "TYPE_UINT64": ov.Type.u64,
    "TYPE_INT8": ov.Type.i8,
    "TYPE_INT16": ov.Type.i16,
    "TYPE_INT32": ov.Type.i32,
    "TYPE_INT64": ov.Type.i64,
    "TYPE_FP16": ov.Type.f16,
    "TYPE_FP32": ov.Type.f32,
}
_CONFIG_TYPES = {str(element): name for name, element in _ELEMENT_TYPES.items()}
_STREAMS = {"auto": props.streams.Num.AUTO, "numa": props.streams.Num.NUMA}
_HINTS = {
    "latency": hints.PerformanceMode.LATENCY,
    "throughput": hints.PerformanceMode.THROUGHPUT,
    "cumulative_throughput": hints.PerformanceMode.CUMULATIVE_THROUGHPUT,
}
_SUPPORTED_KINDS = ("KIND_CPU", "KIND_AUTO")
_DEVICE = "CPU"

#: builds a ModelConfigError naming a field of the model's config.pbtxt
_Errors = Callable[[str, str], ModelConfigError]


@dataclass(frozen=True, slots=True)
class OpenVinoOptions:
    """The openvino parameters of a model's config, parsed and checked."""

    #: what the model is compiled with (OpenVINO properties).
    properties: dict[str, Any]
    #: the batch dim stays max_batch_size and smaller batches are padded.
    pad_batch: bool
    #: the inputs take the config's dims (RESHAPE_IO_LAYERS).
    reshape_io: bool
    #: a library of custom CPU operations (CPU_EXTENSION_PATH).
    extension: str | None


def parse_options(params: dict[str, str], err: _Errors) -> OpenVinoOptions:
    """Triton's parameter keys, their values case-insensitive; bad values name the key."""
    properties: dict[str, Any] = {hints.inference_precision: ov.Type.f32}
    for key, prop in (
        ("INFERENCE_NUM_THREADS", props.inference_num_threads),
        ("COMPILATION_NUM_THREADS", props.compilation_num_threads),
    ):
        if key in params:
            properties[prop] = _count(params, key, err)
    if "HINT_BF16" in params:
        if _value(params, "HINT_BF16") != "yes":
            raise err("parameters.HINT_BF16", f"expected YES, got '{params['HINT_BF16']}'")
        properties[hints.inference_precision] = ov.Type.bf16
    if "NUM_STREAMS" in params:
        value = _value(params, "NUM_STREAMS")
        if value not in _STREAMS and not value.isdigit():
            raise err("parameters.NUM_STREAMS", f"expected AUTO, NUMA or a count, got '{value}'")
        properties[props.streams.num] = _STREAMS[value] if value in _STREAMS else int(value)
    if "PERFORMANCE_HINT" in params:
        value = _value(params, "PERFORMANCE_HINT")
        if value not in _HINTS:
            expected = ", ".join(name.upper() for name in _HINTS)
            raise err("parameters.PERFORMANCE_HINT", f"expected {expected}, got '{value}'")
        properties[hints.performance_mode] = _HINTS[value]
    device = _value(params, "TARGET_DEVICE") or "cpu"
    if device != "cpu":
        raise err(
            "parameters.TARGET_DEVICE", f"'{device.upper()}': sluice runs OpenVINO on CPU only"
        )
    return OpenVinoOptions(
        properties=properties,
        pad_batch=_yes(params, "ENABLE_BATCH_PADDING") or _yes(params, "SKIP_OV_DYNAMIC_BATCHSIZE"),
        reshape_io=_yes(params, "RESHAPE_IO_LAYERS"),
        extension=params.get("CPU_EXTENSION_PATH") or None,
    )


def load_instance(
    spec: ModelSpec, model_dir: Path, version: int, device: torch.device, index: int
) -> TensorFunction:
    """The version's model compiled for CPU, run by one infer request."""
    compiled, batch = compile_model(spec, model_dir, version)
    request = compiled.create_infer_request()
    ports = {o.name: _port(compiled.outputs, o.name) for o in spec.outputs}

    def infer(inputs: dict[str, Any]) -> dict[str, Any]:
        feed = {name: _array(value) for name, value in inputs.items()}
        rows = len(next(iter(feed.values()))) if batch else 0
        if rows < batch:
            feed = {name: _pad(array, batch) for name, array in feed.items()}
        results = request.infer(feed, share_inputs=True, share_outputs=False)
        outputs = {name: results[port] for name, port in ports.items()}
        return {name: value[:rows] for name, value in outputs.items()} if rows < batch else outputs

    return infer


def compile_model(spec: ModelSpec, model_dir: Path, version: int) -> tuple[Any, int]:
    """The version's model, its config checked against it, compiled for CPU with the config's
    parameters; and the batch it takes when that is fixed (0: any up to max_batch_size)."""
    config = model_dir / CONFIG_FILENAME
    options = parse_options(spec.parameters, _config_errors(config))
    if spec.instance_kind not in _SUPPORTED_KINDS:
        raise _unable(spec, "the OpenVINO backend supports only Kind CPU and AUTO")
    core = ov.Core()
    if options.extension is not None:
        try:
            core.add_extension(options.extension)
        except RuntimeError as exc:
            raise ModelConfigError(
                f"{config}: parameters.CPU_EXTENSION_PATH: cannot load '{options.extension}': {exc}"
            ) from exc
    model = _read(core, model_dir / str(version) / spec.model_filename)
    model, batch = _prepare(spec, model, options)
    try:
        with signal_stack_kept():  # OpenVINO's own is unmapped with the model, on any thread
            return core.compile_model(model, _DEVICE, options.properties), batch
    except RuntimeError as exc:
        raise ModelConfigError(f"{config}: parameters: cannot compile the model: {exc}") from exc


def complete_config(cfg: ModelConfig, model_dir: Path) -> None:
    """Triton's auto-complete: when config.pbtxt leaves its inputs or outputs out, fill them
    in from the model. It batches when every tensor's layout has a batch dim: then
    `max_batch_size` 4 if none is set, and dynamic batching when it is above 1."""
    if cfg.input and cfg.output:
        return
    path = newest_model_file(model_dir, cfg.default_model_filename or "model.xml")
    if path is None:
        return  # the scan reports the missing file
    model = _read(ov.Core(), path)
    inputs, outputs = model.inputs, model.outputs
    batching = all(
        ov.layout_helpers.has_batch(ov.layout_helpers.get_layout(port))
        for port in [*inputs, *outputs]
    )
    if batching:
        complete_batching(cfg)
    elif cfg.max_batch_size != 0:
        log.warning(
            "model layout for model %s does not support batching while non-zero "
            "max_batch_size is specified",
            cfg.name,
        )
    if not cfg.input:
        for port in inputs:
            _fill_tensor(cfg.input.add(), port, cfg.max_batch_size, path)
    if not cfg.output:
        for port in outputs:
            _fill_tensor(cfg.output.add(), port, cfg.max_batch_size, path)


def _fill_tensor(io: Any, port: Any, max_batch_size: int, path: Path) -> None:
    """One config input or output from a model tensor: its dims without the batch dim, -1 for
    a dynamic one (Triton writes -1 for every dim of a tensor that has a dynamic one)."""
    io.name = port.get_any_name()
    element = str(port.get_element_type())
    if element not in _CONFIG_TYPES:
        raise ModelConfigError(
            f"{path}: '{io.name}' is of type {element}, which the OpenVINO backend serves as no "
            "Triton data type"
        )
    io.data_type = DataType.Value(_CONFIG_TYPES[element])
    io.dims.extend(_dims(port.get_partial_shape())[1 if max_batch_size > 0 else 0 :])


def _prepare(spec: ModelSpec, model: Any, options: OpenVinoOptions) -> tuple[Any, int]:
    """Check the config against the model and shape the model after it: the batch dim,
    RESHAPE_IO_LAYERS, the config's data types (by conversion). The model, and the batch it
    takes when that is fixed (0: any)."""
    batching = spec.max_batch_size > 0
    if len(model.inputs) != len(spec.inputs):
        raise _unable(
            spec,
            f"configuration expects {len(spec.inputs)} inputs, model provides {len(model.inputs)}",
        )
    inputs = {name: port for port in model.inputs for name in port.get_names()}
    shapes = {}
    for io in spec.inputs:
        port = _allowed(inputs, io.name, "input")
        dims = io.reshape if io.reshape is not None else io.dims
        if options.reshape_io:
            shape = [-1, *dims] if batching else list(dims)
        else:
            _compare_dims(spec, io.name, port.get_partial_shape(), dims, exact=False)
            shape = list(_dims(port.get_partial_shape()))
        if batching:
            shape[0] = spec.max_batch_size if options.pad_batch else -1
        shapes[io.name] = ov.PartialShape(
            [
                ov.Dimension(1, spec.max_batch_size) if d == -1 and batching and i == 0 else d
                for i, d in enumerate(shape)
            ]
        )
    if batching or options.reshape_io:
        try:
            model.reshape(shapes)
        except RuntimeError as exc:
            raise _unable(spec, f"the model cannot take its config's shapes: {exc}") from exc
    outputs = {name: port for port in model.outputs for name in port.get_names()}
    for io in spec.outputs:
        port = _allowed(outputs, io.name, "output")
        dims = io.reshape if io.reshape is not None else io.dims
        _compare_dims(spec, io.name, port.get_partial_shape(), dims, exact=True)
    fixed = spec.max_batch_size if batching and options.pad_batch else 0
    return _convert_types(spec, model), fixed


def _convert_types(spec: ModelSpec, model: Any) -> Any:
    """The model with each tensor as the config's data type (OpenVINO converts)."""
    ppp = PrePostProcessor(model)
    for label, ios in (("input", spec.inputs), ("output", spec.outputs)):
        for io in ios:
            dtype = wire_to_config(io.datatype)
            if dtype not in _ELEMENT_TYPES:
                raise ModelConfigError(
                    f"unsupported datatype {dtype} for {label} '{io.name}' for model '{spec.name}'"
                )
            side = ppp.input(io.name) if label == "input" else ppp.output(io.name)
            side.tensor().set_element_type(_ELEMENT_TYPES[dtype])
    return ppp.build()


def _compare_dims(
    spec: ModelSpec, name: str, model_shape: Any, dims: tuple[int, ...], *, exact: bool
) -> None:
    """Triton's check of config dims against the model's: the batch dim and the config's -1
    are not compared for inputs (exact, for outputs, compares every dim after the batch)."""
    shape = _dims(model_shape)
    batching = spec.max_batch_size > 0
    if batching and not shape:
        raise ModelConfigError(
            f"model '{spec.name}', tensor '{name}': for the model to support batching the "
            "shape should have at least 1 dimension"
        )
    full = (spec.max_batch_size, *dims) if batching else dims
    matches = len(shape) == len(full) and all(
        _matches(model_shape[i], d)
        for i, d in enumerate(full)
        if not (batching and i == 0) and (exact or not batching or d != -1)
    )
    if matches:
        return
    specified = (
        f"{len(full)} dimensions (an initial batch dimension because max_batch_size > 0 "
        f"followed by the explicit tensor shape, making complete shape {_text(full)})"
        if batching
        else f"{len(full)} dimensions (shape {_text(full)})"
    )
    raise ModelConfigError(
        f"model '{spec.name}', tensor '{name}': the model expects {len(shape)} dimensions "
        f"(shape {_text(shape)}) but the model configuration specifies {specified}"
    )


def _matches(dim: Any, value: int) -> bool:
    if dim.is_static:
        return bool(dim.get_length() == value)
    lower, upper = int(dim.get_min_length()), int(dim.get_max_length())
    return upper == -1 or lower <= value <= upper


def _allowed(ports: dict[str, Any], name: str, label: str) -> Any:
    if name not in ports:
        raise ModelConfigError(
            f"unexpected inference {label} '{name}', allowed {label}s are: "
            + ", ".join(sorted({p.get_any_name() for p in ports.values()}))
        )
    return ports[name]


def _port(ports: list[Any], name: str) -> Any:
    return next(p for p in ports if name in p.get_names())


def _dims(shape: Any) -> tuple[int, ...]:
    return tuple(d.get_length() if d.is_static else -1 for d in shape)


def _text(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _array(value: Any) -> np.ndarray:
    """A contiguous numpy view of a host tensor (a copy only when it is not contiguous)."""
    array = value.numpy() if isinstance(value, torch.Tensor) else value
    return np.ascontiguousarray(array)


def _pad(array: np.ndarray, batch: int) -> np.ndarray:
    padded = np.zeros((batch, *array.shape[1:]), dtype=array.dtype)
    padded[: len(array)] = array
    return padded


def _read(core: Any, path: Path) -> Any:
    try:
        return core.read_model(str(path))
    except RuntimeError as exc:
        raise ModelConfigError(f"{path}: cannot read OpenVINO model: {exc}") from exc


def _config_errors(config: Path) -> _Errors:
    return lambda field, message: ModelConfigError(f"{config}: {field}: {message}")


def _value(params: dict[str, str], key: str) -> str:
    return params.get(key, "").strip().lower()


def _yes(params: dict[str, str], key: str) -> bool:
    return _value(params, key) == "yes"


def _count(params: dict[str, str], key: str, err: _Errors) -> int:
    value = _value(params, key)
    if not value.isdigit():
        raise err(f"parameters.{key}", f"expected a non-negative number, got '{value}'")
    return int(value)


def _unable(spec: ModelSpec, reason: str) -> ModelConfigError:
    return ModelConfigError(f"unable to load model '{spec.name}', {reason}")
