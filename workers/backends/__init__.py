"""The backend seam: which module loads a model of each kind, and what it needs installed.

A backend is a module of this package, imported only when a model of its kind loads, that
defines `load_instance(spec, model_dir, version, device, index)`, returning a `TensorFunction`
(which `load_instance` here runs as a StackedInstance) or, for a backend with `own_instances`,
a `ModelInstance` of its own; and, optionally,
`complete_config(cfg, model_dir) -> None` (Triton's auto-complete: fill in, in place, the
inputs, outputs and batching that config.pbtxt leaves out and the model's own file says).
A backend whose packages are not installed, or that needs an NVIDIA GPU where none is present,
makes its models UNAVAILABLE with the reason (and the extra to install); the worker's other
models serve.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import BACKEND_RULES, ModelSpec, TensorSpec
from sluice.workers.devices import placement
from sluice.workers.instances.model_instance import ModelInstance
from sluice.workers.instances.stacked import StackedInstance, TensorFunction
from tritonclient.grpc.model_config_pb2 import ModelConfig

log = logging.getLogger(__name__)

#: Triton's --backend-config=<backend>,default-max-batch-size default, for auto-complete.
DEFAULT_MAX_BATCH_SIZE = 4


@dataclass(frozen=True, slots=True)
class Backend:
    """Where a kind's loader lives and what it needs."""

    #: the module in this package that loads it.
    module: str
    #: the import names of the packages it needs beyond the worker's own.
    requires: tuple[str, ...] = ()
    #: the sluice-serve extra that installs them.
    extra: str | None = None
    #: the batch's inputs are stacked in host memory whatever the instance's kind (the
    #: backend moves them to its device itself).
    host_inputs: bool = False
    #: it runs only on an NVIDIA GPU (CUDA).
    needs_cuda: bool = False
    #: environment variables its packages read as they are imported, unless already set.
    environment: tuple[tuple[str, str], ...] = ()
    #: its loader makes ModelInstances of its own kinds (the others' load a TensorFunction,
    #: which runs as a StackedInstance).
    own_instances: bool = False


#: keyed by ModelSpec.kind (shared/model_config.py BACKEND_RULES).
BACKENDS: dict[str, Backend] = {
    "pytorch": Backend("torchscript"),
    "python": Backend("python", own_instances=True),
    "onnxruntime": Backend("onnxruntime", ("onnxruntime",), "onnx", host_inputs=True),
    "torch_aoti": Backend("torch_aoti"),
    "fil": Backend("fil", ("treelite",), "fil", host_inputs=True),
    "tensorflow": Backend(
        "tensorflow",
        ("tensorflow",),
        "tensorflow",
        host_inputs=True,
        # TensorFlow's own INFO lines (CPU features it was not built for) stay out of the
        # worker's log; its warnings and errors still reach it
        environment=(("TF_CPP_MIN_LOG_LEVEL", "1"),),
    ),
    "openvino": Backend("openvino", ("openvino",), "openvino", host_inputs=True),
    "tensorrt": Backend("tensorrt", ("tensorrt",), "tensorrt", needs_cuda=True),
}


def instance_devices(spec: ModelSpec) -> tuple[torch.device, ...]:
    """Each instance's device, placed as Triton places `instance_group` on the GPUs this worker
    sees (`sluice.workers.devices.placement`; ModelConfigError with Triton's reason for KIND_GPU it
    cannot honour); all CPU for a backend that takes its inputs in host memory (it picks its
    own device)."""
    backend = BACKENDS.get(spec.kind)
    if backend is not None and backend.host_inputs:
        return (torch.device("cpu"),) * spec.instance_count
    return placement.instance_devices(spec.config, torch.cuda.device_count())


def choose_device(spec: ModelSpec) -> torch.device:
    """The model's first instance's device (the one it is reported as running on)."""
    return instance_devices(spec)[0]


def load_instance(
    spec: ModelSpec, model_dir: Path, version: int, device: torch.device, index: int = 0
) -> ModelInstance:
    """The model's instance number `index` (Triton's instance names count them): the one
    place that knows the kinds of instance apart."""
    backend = BACKENDS.get(spec.kind)
    if backend is not None and backend.own_instances:
        where = model_dir / str(version) / spec.model_filename
        module = _backend_module(spec.kind, spec.name, where)
        instance: ModelInstance = module.load_instance(spec, model_dir, version, device, index)
        return instance
    spec = with_sequence_tensors(spec)
    return StackedInstance(spec, load_function(spec, model_dir, version, device, index), device)


def with_sequence_tensors(spec: ModelSpec) -> ModelSpec:
    """The model as its tensor function sees it: under the sequence batcher, the config's
    control inputs and implicit state inputs are among its inputs and its state outputs among
    its outputs (the server fills the first in and keeps the last, workers/sequences/), as
    Triton's backends bind them."""
    config = spec.config
    if not config.sequence_batched or not (config.sequence_controls or config.sequence_states):
        return spec
    controls = [_tensor(c.name, c.datatype, (1,)) for c in config.sequence_controls]
    states = [_tensor(s.input_name, s.datatype, s.initial_dims) for s in config.sequence_states]
    outputs = [_tensor(s.output_name, s.datatype, s.initial_dims) for s in config.sequence_states]
    names = {o.name for o in spec.outputs}
    return dataclasses.replace(
        spec,
        inputs=(*spec.inputs, *controls, *states),
        outputs=(*spec.outputs, *(o for o in outputs if o.name not in names)),
    )


def _tensor(name: str, datatype: str, dims: tuple[int, ...]) -> TensorSpec:
    return TensorSpec(name, datatype, dims, None, optional=False, allow_ragged_batch=False)


def load_function(
    spec: ModelSpec, model_dir: Path, version: int, device: torch.device, index: int = 0
) -> TensorFunction:
    """A plain backend's model as the tensor function a StackedInstance runs."""
    module = _backend_module(spec.kind, spec.name, model_dir / str(version) / spec.model_filename)
    function: TensorFunction = module.load_instance(spec, model_dir, version, device, index)
    return function


def complete_config(cfg: ModelConfig, model_dir: Path) -> None:
    """Triton's auto-complete (a `Completer`): the backend of the config's kind fills in what
    config.pbtxt leaves out, if it knows how."""
    kind = _kind_of(cfg)
    if kind not in BACKENDS:
        return  # loading it says there is no such backend
    module = _backend_module(kind, cfg.name, model_dir)
    complete = getattr(module, "complete_config", None)
    if complete is not None:
        complete(cfg, model_dir)


def complete_batching(cfg: ModelConfig) -> None:
    """Triton's auto-complete of a model that can batch: an unset `max_batch_size` becomes the
    default (with Triton's warning), and above 1, without a scheduler, it batches dynamically."""
    if cfg.max_batch_size == 0:
        cfg.max_batch_size = DEFAULT_MAX_BATCH_SIZE
        log.warning(
            "autofilled max_batch_size to %d for model '%s' since batching is supported but no "
            "max_batch_size is specified in model configuration",
            DEFAULT_MAX_BATCH_SIZE,
            cfg.name,
        )
    if cfg.max_batch_size > 1 and not (
        cfg.HasField("dynamic_batching") or cfg.HasField("sequence_batching")
    ):
        cfg.dynamic_batching.SetInParent()


def newest_model_file(model_dir: Path, filename: str) -> Path | None:
    """`filename` in the newest version folder that has it: what auto-complete reads."""
    versions = sorted(
        (int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()),
        reverse=True,
    )
    paths = (model_dir / str(version) / filename for version in versions)
    return next((path for path in paths if path.exists()), None)


def missing_packages(kind: str) -> list[str]:
    """The packages a kind's backend needs that are not installed."""
    return [name for name in BACKENDS[kind].requires if importlib.util.find_spec(name) is None]


def _backend_module(kind: str, model: str, where: Path) -> ModuleType:
    backend = BACKENDS.get(kind)
    if backend is None:
        raise ModelConfigError(f"{where}: no '{kind}' backend in this worker")
    install = f"pip install 'sluice-serve[{backend.extra}]'" if backend.extra else ""
    if backend.needs_cuda and not torch.cuda.is_available():
        packages = _packages(backend.requires)
        raise ModelConfigError(
            f"model '{model}' needs an NVIDIA GPU and {packages}"
            + (f" ({install})" if install else "")
            + ": no CUDA device is present"
        )
    missing = missing_packages(kind)
    if missing:
        raise ModelConfigError(
            f"model '{model}' needs {_packages(missing)}" + (f": {install}" if install else "")
        )
    for name, value in backend.environment:
        os.environ.setdefault(name, value)
    return importlib.import_module(f"{__name__}.{backend.module}")


def _packages(names: list[str] | tuple[str, ...]) -> str:
    return f"the {' and '.join(names)} package{'s' if len(names) > 1 else ''}"


def _kind_of(cfg: ModelConfig) -> str | None:
    """The kind of a config whose platform and backend are filled in (as Triton's autofill)."""
    for rule in BACKEND_RULES:
        if cfg.platform in rule.platforms if cfg.platform else cfg.backend == rule.backend:
            return rule.kind
    return None
