"""PyTorch 2 models (`platform: "torch_aoti"`, `model.pt2`): an AOTInductor package
(`torch._inductor.aoti_compile_and_package`) or a `torch.export.save` ExportedProgram.

Config tensors bind to the call spec's tensors as Triton's torch_aoti binds them: ordinal
`INPUT__<i>` / `OUTPUT__<i>` in call-spec order, or forward-based `ARGS[i]`, `KWARGS[name]`,
`RESULT`, `RESULT[i]`, `RESULT[key]`; an ExportedProgram's inputs also by forward()'s
parameter names; else in config order. Beyond Triton (whose torch_aoti
runs one row at a time), a model exported with a dynamic first dim is batched when
`max_batch_size > 0`; one whose first dim is fixed is refused at load.

An AOTInductor package is compiled for one device: a CPU package runs on the CPU whatever the
instance kind (a GPU instance's inputs are copied back to the host); a CUDA package needs a
GPU. A plain CPU package runs through its library's C API without the GIL (aoti_runner);
others through torch's loader. An ExportedProgram is not compiled and runs on the instance's
device.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sluice.shared.errors import ModelConfigError, ModelExecutionError
from sluice.shared.model_config import ModelSpec
from sluice.workers.backends.aoti_runner import ContainerRunner, library_entry
from sluice.workers.backends.pt2_archive import (
    WIRE_DATATYPE,
    DimRange,
    InputSignature,
    aoti_input_signatures,
    aoti_metadata,
    archive_kind,
    leaf_names,
)
from sluice.workers.instances.stacked import TensorFunction
from torch.utils import _pytree as pytree
from torch.utils._sympy.numbers import int_oo

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Program:
    """A loaded .pt2, flat: the call spec's tensors in, its tensors out, in call-spec order."""

    run: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]
    device: torch.device
    input_names: list[str]
    output_names: list[str]
    inputs: list[InputSignature]
    #: forward()'s parameter names of the inputs, where the archive keeps them
    argument_names: list[str] | None = None


def load_instance(
    spec: ModelSpec, model_dir: Path, version: int, device: torch.device, index: int
) -> TensorFunction:
    """The .pt2 on its device, as a stacked-batch function."""
    path = model_dir / str(version) / spec.model_filename
    if not path.is_file():
        raise ModelConfigError(f"{path}: no such file (platform torch_aoti loads model.pt2)")
    if archive_kind(path) == "aoti":
        program = _load_aoti(path, spec, device)
    else:
        program = _load_exported_program(path, device)
    inputs = _bind(
        [t.name for t in spec.inputs],
        program.input_names,
        "input",
        path,
        require_all=True,
        argument_names=program.argument_names,
    )
    outputs = _bind(
        [t.name for t in spec.outputs], program.output_names, "output", path, require_all=False
    )
    _check_inputs(spec, path, program, inputs)
    return _infer(spec, path, program, inputs, outputs)


def _infer(
    spec: ModelSpec,
    path: Path,
    program: Program,
    inputs: dict[str, int],
    outputs: dict[str, int],
) -> TensorFunction:
    order = sorted(inputs, key=inputs.__getitem__)
    run, run_device = program.run, program.device

    def infer(batch: dict[str, Any]) -> dict[str, Any]:
        missing = [name for name in order if name not in batch]
        if missing:
            raise ModelExecutionError(f"model '{spec.name}' needs input {missing[0]!r}")
        # AOTInductor code reads its inputs' memory as compiled: dense, on its device.
        flat = [batch[name].to(run_device).contiguous() for name in order]
        result = run(flat)
        if spec.max_batch_size > 0:
            _check_rows(path, result, len(flat[0]))
        return {name: result[i] for name, i in outputs.items()}

    return infer


def _check_rows(path: Path, result: Sequence[torch.Tensor], rows: int) -> None:
    for tensor in result:
        if tensor.dim() == 0 or tensor.shape[0] != rows:
            raise ModelExecutionError(
                f"{path}: returned {tensor.shape[0] if tensor.dim() else 0} rows for a batch of "
                f"{rows}: batching needs outputs whose first dim is the batch "
                "(export with dynamic_shapes={0: Dim('batch')})"
            )


def _load_aoti(path: Path, spec: ModelSpec, device: torch.device) -> Program:
    run_device = _aoti_run_device(path, spec, device)
    entry = library_entry(path) if run_device.type == "cpu" else None
    if entry is not None:
        runner = ContainerRunner(path, entry)
        in_spec, out_spec = runner.call_spec()
        run: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]] = runner.run
    else:
        in_spec, out_spec, run = _load_with_torch(path, run_device)
    input_names = leaf_names(in_spec, "inputs")
    return Program(
        run,
        run_device,
        input_names,
        leaf_names(out_spec, "outputs"),
        aoti_input_signatures(path, len(input_names)),
    )


def _load_with_torch(
    path: Path, run_device: torch.device
) -> tuple[str, str, Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]]:
    """torch's package loader (CUDA packages, weights beside the library), whose run holds
    the GIL while the model computes."""
    import torch._inductor  # heavy: only a worker with such a model pays it

    try:
        package = torch._inductor.aoti_load_package(
            str(path), device_index=run_device.index if run_device.type == "cuda" else -1
        )
    except RuntimeError as exc:
        raise ModelConfigError(f"{path}: cannot load AOTInductor package: {exc}") from exc
    loader = package.loader
    in_spec, out_spec = loader.get_call_spec()

    def run(flat: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        result: list[torch.Tensor] = loader.run(flat)
        return result

    return in_spec, out_spec, run


def _aoti_run_device(path: Path, spec: ModelSpec, device: torch.device) -> torch.device:
    """Where an AOTInductor package runs: the device it was compiled for (the instance's GPU
    for a CUDA package). A CUDA package where no GPU is, or one compiled for another machine
    or for vector instructions this CPU lacks (it would crash the worker), is refused."""
    metadata = aoti_metadata(path)
    _check_machine(path, metadata)
    compiled_for = metadata.get("AOTI_DEVICE_KEY", "cpu")
    if compiled_for == "cpu":
        if device.type != "cpu":
            log.warning(
                "model %r: %s is compiled for the CPU: it runs there, not on %s",
                spec.name,
                path,
                device,
            )
        return torch.device("cpu")
    if compiled_for != "cuda":
        raise ModelConfigError(f"{path}: compiled for '{compiled_for}', which sluice does not run")
    if not torch.cuda.is_available():
        raise ModelConfigError(
            f"{path}: compiled for CUDA but this worker has no GPU: serve it from a GPU worker, "
            "or compile the exported program for the CPU (aoti_compile_and_package on a CPU "
            "machine, inputs on the CPU) for CPU workers"
        )
    if device.type != "cuda":
        log.warning("model %r: %s is compiled for CUDA: it runs on cuda:0", spec.name, path)
        return torch.device("cuda", 0)
    return torch.device("cuda", device.index or 0)


#: the CPU capability (torch's cpuinfo names) each of AOTInductor's vector ISAs needs
_ISA_NEEDS = {
    "AVX2": "avx2",
    "AVX512": "avx512_f",
    "AVX512_VNNI": "avx512_vnni",
    "AMX_TILE": "amx_tile",
}


def _check_machine(path: Path, metadata: dict[str, str]) -> None:
    capabilities = torch.cpu.get_capabilities()
    machine, here = metadata.get("AOTI_MACHINE"), capabilities.get("architecture")
    if machine and here and machine != here:
        raise ModelConfigError(f"{path}: compiled for {machine}, this worker is {here}")
    isas = [isa for isa in metadata.get("AOTI_CPU_ISA", "").upper().split() if isa in _ISA_NEEDS]
    missing = [isa for isa in isas if not capabilities.get(_ISA_NEEDS[isa], False)]
    if missing:
        raise ModelConfigError(
            f"{path}: compiled for a CPU with {' '.join(missing)}, which this worker's CPU "
            "lacks: compile it (aoti_compile_and_package) on the kind of machine that serves it"
        )


def _load_exported_program(path: Path, device: torch.device) -> Program:
    try:
        exported = torch.export.load(str(path))
    except (RuntimeError, ValueError, OSError) as exc:
        raise ModelConfigError(f"{path}: cannot load ExportedProgram: {exc}") from exc
    module = exported.module().to(device)
    in_spec, out_spec = exported.call_spec.in_spec, exported.call_spec.out_spec
    if in_spec is None or out_spec is None:
        raise ModelConfigError(f"{path}: the ExportedProgram has no call spec")
    user_inputs = set(exported.graph_signature.user_inputs)
    placeholders = [
        node.meta.get("val")
        for node in exported.graph.nodes
        if node.op == "placeholder" and node.name in user_inputs
    ]
    signatures = [_signature(value, exported.range_constraints) for value in placeholders]

    def run(flat: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        args, kwargs = pytree.tree_unflatten(flat, in_spec)
        leaves: list[torch.Tensor] = pytree.tree_leaves(module(*args, **kwargs))
        return leaves

    return Program(
        run,
        device,
        leaf_names(pytree.treespec_dumps(in_spec), "inputs"),
        leaf_names(pytree.treespec_dumps(out_spec), "outputs"),
        signatures,
        list(exported.graph_signature.user_inputs),
    )


def _signature(value: object, ranges: dict[Any, Any]) -> InputSignature:
    """An ExportedProgram input's dtype and dims, from its placeholder's fake tensor."""
    if not isinstance(value, torch.Tensor):
        return InputSignature(None, None)
    return InputSignature(
        WIRE_DATATYPE.get(value.dtype), tuple(_dim_range(d, ranges) for d in value.shape)
    )


def _dim_range(size: int | torch.SymInt, ranges: dict[Any, Any]) -> DimRange:
    if isinstance(size, int):
        return DimRange(size, size)
    bounds = ranges.get(size.node.expr)
    if bounds is None:  # an expression of the exported dims: no range of its own
        return DimRange(0, None)
    high = None if bounds.upper == int_oo else int(bounds.upper)
    return DimRange(int(bounds.lower), high)


def _bind(
    config: list[str],
    model: list[str],
    label: str,
    path: Path,
    *,
    require_all: bool,
    argument_names: list[str] | None = None,
) -> dict[str, int]:
    """Each config tensor's position in the call spec: by Triton's ordinal name, by its
    forward-based name, by forward()'s parameter name (an ExportedProgram keeps them), else
    in config order."""
    ordinal = re.compile(rf"^{label.upper()}__(\d+)$")
    ordinals = [ordinal.match(name) for name in config]
    if all(ordinals):
        positions = {name: int(m.group(1)) for name, m in zip(config, ordinals, strict=True) if m}
    elif all(name in model for name in config):
        positions = {name: model.index(name) for name in config}
    elif argument_names and all(name in argument_names for name in config):
        positions = {name: argument_names.index(name) for name in config}
    elif len(config) == len(model):
        positions = {name: i for i, name in enumerate(config)}
    else:
        raise ModelConfigError(
            f"{path}: {label}: config.pbtxt declares {len(config)} {config} but the model has "
            f"{len(model)} {model}; name them {label.upper()}__<i> or by these names"
        )
    beyond = [name for name, i in positions.items() if i >= len(model)]
    if beyond:
        raise ModelConfigError(
            f"{path}: {label} '{beyond[0]}': the model has only {len(model)} {label}s {model}"
        )
    if require_all and len(set(positions.values())) != len(model):
        unbound = [model[i] for i in range(len(model)) if i not in positions.values()]
        raise ModelConfigError(
            f"{path}: {label}: the model also takes {unbound}, which config.pbtxt does not bind"
        )
    return positions


def _check_inputs(spec: ModelSpec, path: Path, program: Program, inputs: dict[str, int]) -> None:
    """Refuse at load what would fail, or read memory as what it is not, at the first batch:
    a datatype or dims other than the model's, a fixed first dim where the model batches."""
    batched = spec.max_batch_size > 0
    for tensor in spec.inputs:
        signature = program.inputs[inputs[tensor.name]]
        where = f"{path}: input '{tensor.name}' ({program.input_names[inputs[tensor.name]]})"
        if tensor.datatype == "BYTES":
            raise ModelConfigError(
                f"{where}: BYTES cannot reach a .pt2 model (torch has no string tensors)"
            )
        if signature.datatype is not None and signature.datatype != tensor.datatype:
            raise ModelConfigError(
                f"{where}: config.pbtxt says TYPE_{tensor.datatype} but the model takes "
                f"{signature.datatype}"
            )
        if signature.dims is None:
            continue
        if batched and not signature.dims:
            raise ModelConfigError(f"{where}: the model takes a scalar, which cannot batch")
        config_dims = tensor.reshape if tensor.reshape is not None else tensor.dims
        model_dims = signature.dims[1:] if batched else signature.dims
        if len(model_dims) != len(config_dims):
            raise ModelConfigError(
                f"{where}: the model takes {len(model_dims)} dims"
                f"{' after the batch dim' if batched else ''}, config.pbtxt gives "
                f"{len(config_dims)}"
            )
        for at, (size, model) in enumerate(zip(config_dims, model_dims, strict=True)):
            if model.fixed and size != model.low:
                raise ModelConfigError(
                    f"{where}: dims[{at}] is {size} in config.pbtxt but {model.low} in the model"
                )
        if batched:
            _check_batch_dim(where, signature.dims[0], spec.max_batch_size)


def _check_batch_dim(where: str, dim: DimRange, max_batch_size: int) -> None:
    if dim.fixed:
        raise ModelConfigError(
            f"{where}: exported with a fixed first dim of {dim.low}, so it cannot batch "
            f"(max_batch_size {max_batch_size}): export with "
            "dynamic_shapes={0: Dim('batch')}, or set max_batch_size: 0"
        )
    if dim.high is not None and dim.high < max_batch_size:
        raise ModelConfigError(
            f"{where}: exported for batches of at most {dim.high}, below max_batch_size "
            f"{max_batch_size}"
        )
