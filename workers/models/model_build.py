"""A model's instances built from its files: the versions on their placed devices, an
ensemble's steps checked against the repository, a load's `file:` overrides written out.

Everything here blocks (files, imports, weights); the model manager runs it on a thread, or
before the worker serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from sluice.shared.ensemble import EnsembleError, build_plan, collect_configs
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import Completer
from sluice.shared.redis_client import AsyncClient
from sluice.shared.repository import ModelEntry, scan_model, scan_repository
from sluice.shared.repository_control import DesiredModel, model_name_problem, read_files
from sluice.workers.backends import instance_devices, load_instance
from sluice.workers.instances.model_instance import ModelInstance
from sluice.workers.instances.warmup import warm_up
from sluice.workers.models.override_files import OverrideDirectory

log = logging.getLogger(__name__)

#: ModelSpec.kind of an ensemble, which runs no instance of its own.
ENSEMBLE_KIND = "ensemble"

#: a loaded model: its entry (instance_count as placed), instances per version, first device,
#: and the statistics its warm-up runs add (shared/stats.py increments).
Loaded = tuple[ModelEntry, dict[int, list[ModelInstance]], torch.device, list[str | int]]


def configure_threads(entries: list[ModelEntry]) -> None:
    """Apply the PyTorch backend's INTRA/INTER_OP_THREAD_COUNT (process-wide in torch)."""
    specs = [e.spec for e in entries if e.spec is not None]
    intra = {s.intra_op_threads for s in specs if s.intra_op_threads}
    inter = {s.inter_op_threads for s in specs if s.inter_op_threads}
    if len(intra) > 1 or len(inter) > 1:
        log.warning(
            "models ask for different thread counts; using the largest (torch threads are "
            "per process: run them in separate workers with --models to honour each)"
        )
    if intra:
        torch.set_num_threads(max(intra))
    if inter:
        try:
            torch.set_num_interop_threads(max(inter))
        except RuntimeError as exc:  # already set in this process
            log.warning("INTER_OP_THREAD_COUNT not applied: %s", exc)


def load_model(entry: ModelEntry) -> Loaded:
    """Every selected version, one instance on each placed device, each warmed up as the config
    says (workers/instances/warmup.py); the entry comes back with its spec's `instance_count`
    the number placed (a GPU group's count is per GPU)."""
    assert entry.spec is not None
    devices = instance_devices(entry.spec)
    spec = replace(entry.spec, instance_count=len(devices))
    instances = {
        version: [
            load_instance(spec, entry.path, version, device, index)
            for index, device in enumerate(devices)
        ]
        for version in entry.versions
    }
    warmup: list[str | int] = []
    try:
        for version, lanes in instances.items():
            for instance in lanes:
                warmup += warm_up(spec, entry.path, version, instance)
    except ModelConfigError:
        for lanes in instances.values():
            for instance in lanes:
                instance.close()
        raise
    return replace(entry, spec=spec), instances, devices[0], warmup


def check_ensemble(entry: ModelEntry, repository: Path, complete: Completer | None) -> None:
    """An ensemble "loads" once its steps check out against the repository's composing models
    (loaded here or not: any worker may serve them); EnsembleError with Triton's reason."""
    assert entry.spec is not None

    def config_of(name: str) -> Mapping[str, object] | None:
        if entry.spec is not None and name == entry.name:
            return entry.spec.config_json
        if model_name_problem(name) is not None or not (repository / name).is_dir():
            return None  # a step's name from a config on the wire: never another directory
        found = scan_model(repository / name, complete=complete)
        if found.spec is None or found.error:
            raise EnsembleError(
                f"ensemble '{entry.name}' depends on '{name}' which is not valid. Model "
                f"'{name}' failed with error: {found.error}"
            )
        return found.spec.config_json

    build_plan(entry.name, collect_configs(entry.name, config_of))


def entries_at_start(
    repository: Path,
    models: tuple[str, ...] | None,
    only: set[str] | None,
    complete: Completer | None,
) -> list[ModelEntry]:
    """The repository's models a worker loads at start: those of `--models` (`models`), and
    of them `--load-model`'s (`only`) when given; each name asked for and missing is logged."""
    entries = scan_repository(repository, complete=complete)
    for missing in (only or set()) - {e.name for e in entries}:
        log.error("--load-model %r: no such model in %s", missing, repository)
    if models is not None:
        entries = [e for e in entries if e.name in models]
        for missing in set(models) - {e.name for e in entries}:
            log.error("model %r is not in %s", missing, repository)
    if only is not None:
        entries = [e for e in entries if e.name in only]
    return entries


async def build(
    redis: AsyncClient,
    name: str,
    wanted: DesiredModel,
    model_dir: Path,
    repository: Path,
    complete: Completer | None,
    overrides: OverrideDirectory,
) -> Loaded:
    """The model's entry and instances, from its directory or (`file:` overrides, read from
    Redis) from the private one they are written to; off the event loop."""
    if wanted.has_files:
        files = await read_files(redis, name)
        await asyncio.to_thread(overrides.write, model_dir, files)
    entry = await asyncio.to_thread(
        scan_model, model_dir, config_json=wanted.config_json, complete=complete
    )
    if entry.error or entry.spec is None:
        raise ModelConfigError(entry.error or "no model config")
    if entry.spec.kind == ENSEMBLE_KIND:
        await asyncio.to_thread(check_ensemble, entry, repository, complete)
        return entry, {}, torch.device("cpu"), []
    return await asyncio.to_thread(load_model, entry)
