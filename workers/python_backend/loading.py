"""Importing a Python model file as Triton does, building its instances, and its config's
auto-completion.

Triton imports `<model>/<version>/model.py` with the version directory and the model directory
on `sys.path`, so sibling modules import normally. One sluice worker serves many models in one
process, where Triton runs a process per instance, so each instance's file is imported as a
module of its own name (two models' `1/model.py` never clash), its own folders come first on
`sys.path` while it is imported (its `helper.py`, not another model's), and the modules it
imported from its model directory are then dropped from `sys.modules`: each instance keeps
its own copies, and a reload reads them afresh.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import torch
from google.protobuf import json_format
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import ModelSpec, triton_config_json
from sluice.workers.devices.placement import Slot, instance_slots
from sluice.workers.python_backend import pb_utils
from sluice.workers.python_backend.context import Instance, running
from sluice.workers.python_backend.custom_metrics import release as release_metrics
from sluice.workers.python_backend.instance import TritonInstance
from sluice.workers.python_backend.model_config import ModelConfig
from tritonclient.grpc.model_config_pb2 import ModelConfig as ModelConfigProto

TRITON_CLASS = "TritonPythonModel"

#: imports change `sys.path` and `sys.modules` for their while: one at a time.
_importing = threading.Lock()


def import_model_file(model: str, version: int, path: Path, tag: str) -> ModuleType:
    """Import `path` as a module of its own (named after model, version and `tag`), with
    `triton_python_backend_utils` importable and the file's folders on `sys.path`."""
    pb_utils.install()
    name = f"sluice_model_{model}_{version}_{tag}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelConfigError(f"{path}: not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    own = [str(path.parent), str(path.parent.parent)]
    with _importing:
        before = set(sys.modules)
        sys.path[:0] = own
        sys.modules[name] = module  # as an import does: dataclasses and pickling look it up
        token = pb_utils.model_dir.set(path.parent)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # user code: any failure is a load failure, with its reason
            del sys.modules[name]
            raise ModelConfigError(f"{path}: import failed: {exc!r}") from exc
        finally:
            pb_utils.model_dir.reset(token)
            for folder in own:
                sys.path.remove(folder)
            sys.path.extend(folder for folder in own if folder not in sys.path)
            _forget_modules_under(path.parent.parent, set(sys.modules) - before - {name})
    return module


def _forget_modules_under(folder: Path, names: set[str]) -> None:
    """Drop the modules among `names` loaded from files under `folder`."""
    root = folder.resolve()
    for name in names:
        source = getattr(sys.modules[name], "__file__", None)
        if source is not None and Path(source).resolve().is_relative_to(root):
            del sys.modules[name]


def initialize_args(
    spec: ModelSpec, model_dir: Path, version: int, device: torch.device, index: int
) -> dict[str, str]:
    """Triton's seven `initialize(args)` keys for the model's instance number `index`, on
    `device` (where `sluice.workers.devices.placement` put it)."""
    slots = instance_slots(spec.config, torch.cuda.device_count())
    slot = slots[index] if index < len(slots) else Slot(spec.name, "KIND_AUTO", index, device)
    if device.type == "cuda":
        kind_text, device_id = "GPU", str(device.index or 0)
    else:
        kind_text, device_id = ("MODEL" if slot.kind == "KIND_MODEL" else "CPU"), "0"
    return {
        "model_config": orjson.dumps(spec.config_json).decode(),
        "model_instance_kind": kind_text,
        "model_instance_name": f"{slot.group}_{slot.number}",
        "model_instance_device_id": device_id,
        "model_repository": str(model_dir),
        "model_version": str(version),
        "model_name": spec.name,
    }


def triton_instance(
    spec: ModelSpec,
    model_dir: Path,
    version: int,
    device: torch.device,
    index: int,
    model_class: Any,
    path: Path,
) -> TritonInstance:
    """Build and initialize the model object of instance `index` (ModelConfigError if not)."""
    args = initialize_args(spec, model_dir, version, device, index)
    owner = Instance(args["model_instance_name"])
    try:
        with running(path.parent, owner):
            model = model_class()
            initialize = getattr(model, "initialize", None)
            if initialize is not None:
                initialize(args)
    except Exception as exc:  # user code
        release_metrics(owner)
        raise ModelConfigError(
            f"{path}: {TRITON_CLASS}.initialize failed: {type(exc).__name__}: {exc}"
        ) from exc
    output_types = {o.name: o.datatype for o in spec.outputs}
    # an implicit state's output goes back to the server, which keeps it for the next request
    output_types |= {state.output_name: state.datatype for state in spec.config.sequence_states}
    return TritonInstance(spec.name, model, path.parent, output_types, owner)


def complete_config(config: ModelConfigProto, model_dir: Path) -> None:
    """Triton's auto-complete for a Python model (a `Completer`): its TritonPythonModel's
    `auto_complete_config` fills in what config.pbtxt leaves out (inputs, outputs, batching).

    The newest version's file is imported under a throw-away name, as Triton runs the hook in
    a process of its own; a file that defines no such hook is not imported here."""
    if config.backend != "python":
        return
    path = _newest_model_file(model_dir, config.default_model_filename or "model.py")
    if path is None:
        return
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return  # loading the model reports it
    if "auto_complete_config" not in source:
        return
    module = import_model_file(config.name, int(path.parent.name), path, "autocomplete")
    del sys.modules[module.__name__]
    hook = getattr(getattr(module, TRITON_CLASS, None), "auto_complete_config", None)
    if hook is None:
        return
    try:
        returned = hook(ModelConfig(triton_config_json(config)))
    except Exception as exc:  # user code
        raise ModelConfigError(
            f"{path}: auto_complete_config failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(returned, ModelConfig):
        raise ModelConfigError(
            f"{path}: auto_complete_config must return the pb_utils.ModelConfig it was given, "
            f"got {type(returned).__name__}"
        )
    try:
        completed = json_format.ParseDict(returned.as_dict(), ModelConfigProto())
    except json_format.ParseError as exc:
        raise ModelConfigError(
            f"{path}: auto_complete_config gave an invalid config: {exc}"
        ) from exc
    config.CopyFrom(completed)


def _newest_model_file(model_dir: Path, filename: str) -> Path | None:
    try:
        versions = sorted(
            (int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()),
            reverse=True,
        )
    except OSError:
        return None
    return next(
        (
            model_dir / str(v) / filename
            for v in versions
            if (model_dir / str(v) / filename).is_file()
        ),
        None,
    )
