"""What a `.pt2` archive holds, read without running it: an AOTInductor package or a
`torch.export.save` ExportedProgram, its call spec's tensor names, and what each input must be.

An AOTInductor package records its inputs' dtypes and fixed sizes only in the C++ wrapper it
ships (the checks that `AOTI_RUNTIME_CHECK_INPUTS=1` turns on). Those checks cannot simply be
turned on when serving: a package compiled with the default `check_lowerbound` refuses a
dynamic batch of 1. So the wrapper is read here instead, once, when the model loads: a batch
dim compiled as a fixed size, or a dtype other than the config's, is refused before any batch
runs, rather than read past the end of a buffer or reinterpreted.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from sluice.shared.errors import ModelConfigError

#: the model name aoti_compile_and_package gives the one model it packages.
AOTI_MODEL = "model"

#: Triton's wire datatypes by torch dtype.
WIRE_DATATYPE: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "UINT8",
    torch.uint16: "UINT16",
    torch.uint32: "UINT32",
    torch.uint64: "UINT64",
    torch.int8: "INT8",
    torch.int16: "INT16",
    torch.int32: "INT32",
    torch.int64: "INT64",
    torch.float16: "FP16",
    torch.bfloat16: "BF16",
    torch.float32: "FP32",
    torch.float64: "FP64",
}
#: ATen's scalar type names (as the wrapper's dtype checks print them) by torch dtype.
_ATEN_DTYPE = {
    "Bool": torch.bool,
    "Byte": torch.uint8,
    "UInt16": torch.uint16,
    "UInt32": torch.uint32,
    "UInt64": torch.uint64,
    "Char": torch.int8,
    "Short": torch.int16,
    "Int": torch.int32,
    "Long": torch.int64,
    "Half": torch.float16,
    "BFloat16": torch.bfloat16,
    "Float": torch.float32,
    "Double": torch.float64,
}
# The wrapper's input checks, as torch 2.13's cpp_wrapper_cpu.py writes them.
_CHECK_DTYPE = re.compile(
    r'input_handles\[(\d+)\]: unmatched dtype, "\s*<< "expected: " << \w+ << "\(at::k(\w+)\)'
)
_CHECK_FIXED = re.compile(
    r'input_handles\[(\d+)\]: unmatched dim value at (\d+), "\s*<< "expected: (\d+), "'
)
_CHECK_LOW = re.compile(
    r'input_handles\[(\d+)\]: dim value is too small at (\d+), "'
    r'\s*<< "expected it to be >= (\d+), "'
)
_CHECK_HIGH = re.compile(
    r'input_handles\[(\d+)\]: dim value is too large at (\d+), "\s*<< "expected to be <= (\d+), "'
)
#: every dim of a dense input has a stride check, if only on the last (stride 1)
_CHECK_STRIDE = re.compile(r'input_handles\[(\d+)\]: unmatched stride value at (\d+), "')

ArchiveKind = Literal["aoti", "exported_program"]


@dataclass(frozen=True, slots=True)
class DimRange:
    """The sizes an input's first dim was exported for; `high` None: no upper bound."""

    low: int
    high: int | None

    @property
    def fixed(self) -> bool:
        return self.low == self.high


@dataclass(frozen=True, slots=True)
class InputSignature:
    """What the archive says one input must be; None: it does not say."""

    datatype: str | None
    #: one range per dim
    dims: tuple[DimRange, ...] | None


def archive_kind(path: Path) -> ArchiveKind:
    """ "aoti" for an AOTInductor package (compiled code; preferred when an archive holds
    both), "exported_program" for a torch.export.save archive; ModelConfigError otherwise."""
    names = _entries(path)
    if any(parts[1:4] == ["data", "aotinductor", AOTI_MODEL] for parts in names):
        return "aoti"
    if any(parts[1:2] == ["models"] and parts[-1].endswith(".json") for parts in names):
        return "exported_program"
    models = sorted({p[3] for p in names if p[1:3] == ["data", "aotinductor"] and len(p) > 4})
    if models:
        raise ModelConfigError(
            f"{path}: the AOTInductor package holds models {models} but not '{AOTI_MODEL}', "
            "the one aoti_compile_and_package writes"
        )
    raise ModelConfigError(
        f"{path}: neither an AOTInductor package (torch._inductor.aoti_compile_and_package) nor "
        "an ExportedProgram (torch.export.save)"
    )


def aoti_input_signatures(path: Path, count: int) -> list[InputSignature]:
    """Each input's dtype and dims, read from the package's C++ wrapper (unknown when the
    package ships none)."""
    source = _wrapper_source(path)
    dtypes = {int(i): _ATEN_DTYPE.get(name) for i, name in _CHECK_DTYPE.findall(source)}
    checks = {
        "fixed": _by_input_and_dim(_CHECK_FIXED.findall(source)),
        "low": _by_input_and_dim(_CHECK_LOW.findall(source)),
        "high": _by_input_and_dim(_CHECK_HIGH.findall(source)),
    }
    checked_dims: dict[int, int] = {}
    fixed_dims = [(index, dim) for index, dim, _ in _CHECK_FIXED.findall(source)]
    for index, dim in [*_CHECK_STRIDE.findall(source), *fixed_dims]:
        checked_dims[int(index)] = max(checked_dims.get(int(index), 0), int(dim) + 1)
    signatures = []
    for index in range(count):
        dtype = dtypes.get(index)
        rank = checked_dims.get(index)
        dims = None if rank is None else tuple(_range(checks, index, d) for d in range(rank))
        signatures.append(InputSignature(WIRE_DATATYPE.get(dtype) if dtype else None, dims))
    return signatures


def _by_input_and_dim(found: list[tuple[str, str, str]]) -> dict[tuple[int, int], int]:
    return {(int(index), int(dim)): int(size) for index, dim, size in found}


def _range(checks: dict[str, dict[tuple[int, int], int]], index: int, dim: int) -> DimRange:
    fixed = checks["fixed"].get((index, dim))
    if fixed is not None:
        return DimRange(fixed, fixed)
    return DimRange(checks["low"].get((index, dim), 0), checks["high"].get((index, dim)))


def aoti_metadata(path: Path) -> dict[str, str]:
    """What an AOTInductor package says it was compiled for: AOTI_DEVICE_KEY ("cpu",
    "cuda"), AOTI_MACHINE, AOTI_CPU_ISA ("AVX512 AVX512_VNNI", ...)."""
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if name.split("/")[1:4] == ["data", "aotinductor", AOTI_MODEL] and name.endswith(
                ".wrapper_metadata.json"
            ):
                metadata = json.loads(archive.read(name))
                return {str(key): str(value) for key, value in metadata.items()}
    return {}


def leaf_names(call_spec: str, kind: Literal["inputs", "outputs"]) -> list[str]:
    """Triton's forward-based names of a call spec's tensors, in call-spec order: inputs
    `ARGS[i]`, `KWARGS[name]`, nested `ARGS[i][key]`; outputs `RESULT`, `RESULT[i]`,
    `RESULT[key]`. `call_spec` is the JSON that torch's treespec_dumps writes."""
    _, root = json.loads(call_spec)
    if kind == "outputs":
        return _paths(root, "RESULT")
    args, kwargs = root["children_spec"]  # forward(*args, **kwargs)
    return _paths(args, "ARGS") + _paths(kwargs, "KWARGS")


def _paths(node: dict[str, Any], prefix: str) -> list[str]:
    children = node["children_spec"]
    if node["type"] is None:  # a leaf: a tensor
        return [prefix]
    context = json.loads(node["context"]) if isinstance(node["context"], str) else None
    keys = context if node["type"].endswith("dict") and context else range(len(children))
    return [
        path
        for key, child in zip(keys, children, strict=True)
        for path in _paths(child, f"{prefix}[{key}]")
    ]


def _entries(path: Path) -> list[list[str]]:
    try:
        with zipfile.ZipFile(path) as archive:
            return [name.split("/") for name in archive.namelist()]
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelConfigError(f"{path}: cannot read the .pt2 archive: {exc}") from exc


def _wrapper_source(path: Path) -> str:
    with zipfile.ZipFile(path) as archive:
        wrappers = [
            name
            for name in archive.namelist()
            if name.split("/")[1:4] == ["data", "aotinductor", AOTI_MODEL]
            and name.endswith(".wrapper.cpp")
        ]
        return archive.read(wrappers[0]).decode("utf-8", "replace") if wrappers else ""
