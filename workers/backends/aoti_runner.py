"""Run a CPU AOTInductor package's compiled model through its C API, without the GIL.

torch 2.13's Python bindings of the package loader (`run`, `boxed_run`) hold the GIL while
the model computes: in a worker, the event loop that reads the next requests and publishes
answers then stops for the length of every batch. ctypes lets go of the GIL for the length of
a foreign call, so calling the shared library's `AOTInductorModelContainerRun` directly keeps
the worker's loop running while the model computes, as TorchScript and ONNX Runtime do.

Only a plain CPU package qualifies: one compiled library with its weights inside it (the
default); anything else (CUDA kernels, weights beside the library, C++ to compile at load)
goes through torch's loader.
"""

from __future__ import annotations

import ctypes
import shutil
import tempfile
import weakref
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from sluice.shared.errors import ModelConfigError, ModelExecutionError
from sluice.workers.backends.pt2_archive import AOTI_MODEL

_Handle = ctypes.c_void_p
_FILES_OF_A_PLAIN_PACKAGE = (".cpp", ".json", ".so")

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def library_entry(path: Path) -> str | None:
    """The archive entry of the package's compiled library when it is a plain CPU package
    (the library holds everything the model needs), else None."""
    with zipfile.ZipFile(path) as archive:
        data = [n for n in archive.namelist() if n.split("/")[1:2] == ["data"] and n[-1] != "/"]
    in_model = [n for n in data if n.split("/")[2:4] == ["aotinductor", AOTI_MODEL]]
    libraries = [n for n in in_model if n.endswith(".so")]
    plain = len(in_model) == len(data) and all(n.endswith(_FILES_OF_A_PLAIN_PACKAGE) for n in data)
    return libraries[0] if plain and len(libraries) == 1 else None


class ContainerRunner:
    """One model container of a package's library; `run` takes and returns flat tensors."""

    def __init__(self, path: Path, entry: str) -> None:
        folder = Path(tempfile.mkdtemp(prefix="sluice-aoti-"))
        try:
            with zipfile.ZipFile(path) as archive:
                library = Path(archive.extract(entry, folder))
            self._lib = ctypes.CDLL(str(library))
        except (OSError, zipfile.BadZipFile) as exc:
            raise ModelConfigError(f"{path}: cannot load the compiled model: {exc}") from exc
        finally:
            shutil.rmtree(folder)  # once mapped, the library needs no file
        self._declare()
        handle = _Handle()
        create = self._lib.AOTInductorModelContainerCreateWithDevice
        if create(ctypes.byref(handle), 1, b"cpu", None):
            raise ModelConfigError(f"{path}: the compiled model failed to start")
        self._handle = handle
        outputs = ctypes.c_size_t()
        self._lib.AOTInductorModelContainerGetNumOutputs(handle, ctypes.byref(outputs))
        self._outputs = outputs.value
        self._path = path
        weakref.finalize(self, self._lib.AOTInductorModelContainerDelete, handle)

    def call_spec(self) -> tuple[str, str]:
        """The call spec's JSON (inputs, outputs), as torch's treespec_dumps writes it."""
        in_spec, out_spec = ctypes.c_char_p(), ctypes.c_char_p()
        self._lib.AOTInductorModelContainerGetCallSpec(
            self._handle, ctypes.byref(in_spec), ctypes.byref(out_spec)
        )
        return (in_spec.value or b"").decode(), (out_spec.value or b"").decode()

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        capsules = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(list(tensors))
        inputs = (_Handle * len(capsules))(*(_api.PyCapsule_GetPointer(c, None) for c in capsules))
        outputs = (_Handle * self._outputs)()
        # the inputs' handles are the model's to free; the outputs' are ours
        failed = self._lib.AOTInductorModelContainerRun(
            self._handle, inputs, len(capsules), outputs, self._outputs, None, None
        )
        if failed:
            raise ModelExecutionError(f"{self._path}: the model failed on this batch")
        return list(
            torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
                [_api.PyCapsule_New(o, None, None) for o in outputs]
            )
        )

    def _declare(self) -> None:
        size_p = ctypes.POINTER(ctypes.c_size_t)
        handles = ctypes.POINTER(_Handle)
        functions: dict[str, list[Any]] = {
            "AOTInductorModelContainerCreateWithDevice": [
                ctypes.POINTER(_Handle),
                ctypes.c_size_t,
                ctypes.c_char_p,
                ctypes.c_char_p,
            ],
            "AOTInductorModelContainerGetNumOutputs": [_Handle, size_p],
            "AOTInductorModelContainerGetCallSpec": [
                _Handle,
                ctypes.POINTER(ctypes.c_char_p),
                ctypes.POINTER(ctypes.c_char_p),
            ],
            "AOTInductorModelContainerRun": [
                _Handle,
                handles,
                ctypes.c_size_t,
                handles,
                ctypes.c_size_t,
                _Handle,
                _Handle,
            ],
            "AOTInductorModelContainerDelete": [_Handle],
        }
        for name, argtypes in functions.items():
            function: Callable[..., int] = getattr(self._lib, name)
            function.argtypes = argtypes  # type: ignore[attr-defined]
            function.restype = ctypes.c_int32  # type: ignore[attr-defined]
