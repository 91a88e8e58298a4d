"""A worker's models at run time: load, reload and unload them while the worker serves.

At start the worker loads what its control mode says (every model, or `--load-model`'s). Then
the fleet's desired state (shared/repository_control.py) or, in poll mode, the repository's
own changes drive each model through LOADING, READY, UNLOADING and UNAVAILABLE, one change at
a time per model, reported in the heartbeat with the generation applied:

- A load builds the model (files read and instances made on a thread, so the loop keeps
  serving) and starts its queue; a reload starts the new queue first, then stops the old one,
  which finishes what it holds while the new one reads what is left in the streams. What the
  old one's cancelled read had taken is handed back (workers/handoff.py). A failed reload
  leaves the old queue serving, as Triton keeps the old version.
- An unload stops taking new requests at the gateways (they see UNLOADING or the desired
  state) and finishes the requests already queued: the queue keeps reading until the streams
  hold nothing undelivered and at least UNLOAD_SETTLE_S has passed (every gateway has seen the
  unload by then), runs what it holds, and stops; the model's instances are shut down.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from sluice.shared.ensemble import EnsembleError, build_plan, collect_configs
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import Completer
from sluice.shared.redis_client import REDIS_ERRORS, AsyncClient
from sluice.shared.registry import (
    HEARTBEAT_INTERVAL_S,
    LOADING,
    READY,
    UNAVAILABLE,
    UNLOADING,
    ModelStatus,
)
from sluice.shared.repository import (
    ModelEntry,
    fingerprint,
    model_names,
    scan_model,
    scan_repository,
)
from sluice.shared.repository_control import DesiredModel, override_path, read_files
from sluice.workers.backends import Infer, instance_devices, load_instance
from sluice.workers.handoff import hand_back, undelivered
from sluice.workers.model_queue import ModelQueue

log = logging.getLogger(__name__)

#: an unloading model keeps serving at least this long: gateways refresh their view of the
#: fleet every heartbeat, so by then none sends it new requests.
UNLOAD_SETTLE_S = 2 * HEARTBEAT_INTERVAL_S
#: an unload stops the queue after this long even if requests still arrive.
UNLOAD_DRAIN_LIMIT_S = 30.0
#: how often an unloading queue looks whether its streams are drained.
DRAIN_CHECK_S = 0.05
#: the reason an unloaded model is UNAVAILABLE for (Triton's).
UNLOADED = "unloaded"
#: ModelSpec.kind of an ensemble, which runs no instance of its own.
ENSEMBLE_KIND = "ensemble"

#: builds a model's queue: spec, instances per version, device, consumer name.
QueueFactory = Callable[..., ModelQueue]


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


def load_model(entry: ModelEntry) -> tuple[ModelEntry, dict[int, list[Infer]], torch.device]:
    """Every selected version, one instance on each placed device; the entry comes back with
    its spec's `instance_count` the number placed (a GPU group's count is per GPU)."""
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
    return replace(entry, spec=spec), instances, devices[0]


def check_ensemble(entry: ModelEntry, repository: Path, complete: Completer | None) -> None:
    """An ensemble "loads" once its steps check out against the repository's composing models
    (loaded here or not: any worker may serve them); EnsembleError with Triton's reason."""
    assert entry.spec is not None

    def config_of(name: str) -> Mapping[str, object] | None:
        if entry.spec is not None and name == entry.name:
            return entry.spec.config_json
        if not (repository / name).is_dir():
            return None
        found = scan_model(repository / name, complete=complete)
        if found.spec is None or found.error:
            raise EnsembleError(
                f"ensemble '{entry.name}' depends on '{name}' which is not valid. Model "
                f"'{name}' failed with error: {found.error}"
            )
        return found.spec.config_json

    build_plan(entry.name, collect_configs(entry.name, config_of))


@dataclass(frozen=True, slots=True)
class Source:
    """What a running queue was built from, to tell whether a load changes anything."""

    fingerprint: tuple[tuple[str, int, int], ...]
    #: a config override or `file:` overrides were applied (a plain load then reloads).
    overridden: bool = False
    #: the private directory the `file:` overrides were written to.
    files_dir: Path | None = None


class ModelManager:
    """The models one worker serves, their queues, and their states for the heartbeat."""

    def __init__(
        self,
        repository: Path,
        models: tuple[str, ...] | None,
        consumer: str,
        redis: AsyncClient,
        make_queue: QueueFactory,
        on_change: Callable[[], None],
        overrides_dir: Path,
        complete: Completer | None = None,
    ) -> None:
        self.repository = repository
        self.models = models
        self.consumer = consumer
        self.redis = redis
        self.make_queue = make_queue
        self.on_change = on_change
        self.overrides_dir = overrides_dir
        self.complete = complete
        #: the queue serving each loaded model.
        self.queues: dict[str, ModelQueue] = {}
        #: the ensembles that checked out: no queue, their steps run on their models' queues.
        self.ensembles: dict[str, ModelEntry] = {}
        self.statuses: dict[str, ModelStatus] = {}
        #: resolved with the error of a queue that failed (the worker then exits, as before).
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tasks: dict[ModelQueue, asyncio.Task[None]] = {}
        self._sources: dict[str, Source] = {}
        #: the newest desired state seen per model, and the task applying it.
        self._wanted: dict[str, DesiredModel] = {}
        self._appliers: dict[str, asyncio.Task[None]] = {}
        self._consumer_numbers = itertools.count(1)
        self._poll_generations = itertools.count(1)

    # -- what this worker serves -------------------------------------------------------------

    def scope(self) -> list[str]:
        """The repository's models this worker would serve (`--models` applied)."""
        names = model_names(self.repository)
        if self.models is None:
            return names
        return [n for n in names if n in self.models]

    def in_scope(self, name: str, desired: DesiredModel | None = None) -> bool:
        """Whether this worker applies the model's desired state: it is in the repository,
        or comes with its files, or is served here already (from files: its unload)."""
        if self.models is not None and name not in self.models:
            return False
        if name in self.queues or (desired is not None and desired.has_files):
            return True
        return (self.repository / name).is_dir()

    def announces(self, name: str) -> bool:
        """Whether this worker's config of the model is current (not behind a newer load)."""
        wanted = self._wanted.get(name)
        status = self.statuses.get(name)
        return wanted is None or (status is not None and status.generation == wanted.generation)

    # -- start -------------------------------------------------------------------------------

    def scan_at_start(
        self, only: set[str] | None
    ) -> list[tuple[ModelEntry, dict[int, list[Infer]], torch.device]]:
        """Load the models to serve from the start (`only`: these, else every one); blocking,
        run on a thread before the worker serves."""
        entries = scan_repository(self.repository, complete=self.complete)
        for missing in (only or set()) - {e.name for e in entries}:
            log.error("--load-model %r: no such model in %s", missing, self.repository)
        wanted = set(self.models) if self.models is not None else None
        if wanted is not None:
            entries = [e for e in entries if e.name in wanted]
            for missing in wanted - {e.name for e in entries}:
                log.error("model %r is not in %s", missing, self.repository)
        if only is not None:
            entries = [e for e in entries if e.name in only]
        configure_threads(entries)
        loaded = []
        for entry in entries:
            self._sources[entry.name] = Source(fingerprint(entry.path))
            if entry.error or entry.spec is None:
                log.error("model %r not loaded: %s", entry.name, entry.error)
                self.statuses[entry.name] = ModelStatus([], entry.error)
                continue
            try:
                if entry.spec.kind == ENSEMBLE_KIND:
                    check_ensemble(entry, self.repository, self.complete)
                    self.ensembles[entry.name] = entry
                    self.statuses[entry.name] = ModelStatus(list(entry.versions), None)
                    continue
                entry, instances, device = load_model(entry)
            except ModelConfigError as exc:
                log.error("model %r not loaded: %s", entry.name, exc.message)
                self.statuses[entry.name] = ModelStatus([], exc.message)
                continue
            self.statuses[entry.name] = ModelStatus(list(entry.versions), None)
            loaded.append((entry, instances, device))
            log.info("model %r versions %s ready on %s", entry.name, entry.versions, device)
        return loaded

    def start(self, loaded: list[tuple[ModelEntry, dict[int, list[Infer]], torch.device]]) -> None:
        """Serve what `scan_at_start` loaded, under the worker's own consumer name."""
        for entry, instances, device in loaded:
            self._run(entry.name, self.make_queue(entry.spec, instances, device, self.consumer))

    def _run(self, name: str, queue: ModelQueue) -> None:
        self.queues[name] = queue
        task = asyncio.create_task(queue.run(), name=f"queue:{name}")
        self._tasks[queue] = task
        task.add_done_callback(self._queue_ended)

    def _queue_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None or self.failed.done():
            return
        self.failed.set_exception(task.exception())  # type: ignore[arg-type]

    # -- the fleet's desired state ------------------------------------------------------------

    def follow(self, desired: Mapping[str, DesiredModel]) -> None:
        """Apply every desired state this worker has not applied yet (each model in turn)."""
        for name, wanted in desired.items():
            if not self.in_scope(name, wanted):
                continue
            status = self.statuses.get(name)
            applied = status.generation if status is not None else 0
            if wanted.generation == applied and name not in self._appliers:
                continue
            self._wanted[name] = wanted
            self._ensure_applier(name)

    def _ensure_applier(self, name: str) -> None:
        if name not in self._appliers:
            task = asyncio.create_task(self._apply_all(name), name=f"apply:{name}")
            self._appliers[name] = task

    async def _apply_all(self, name: str) -> None:
        try:
            while True:
                wanted = self._wanted[name]
                status = self.statuses.get(name)
                if status is not None and status.generation == wanted.generation:
                    return
                if wanted.loaded:
                    await self._load(name, wanted)
                else:
                    await self._unload(name, wanted.generation)
        except REDIS_ERRORS as exc:  # tried again on the next heartbeat
            log.warning("%s: applying its desired state failed: %s", name, exc)
        except Exception:  # a bug: say so, and try again on the next heartbeat
            log.exception("%s: applying its desired state failed", name)
        finally:
            del self._appliers[name]

    # -- poll mode ------------------------------------------------------------------------------

    async def poll(self, interval_s: float) -> None:
        """Poll mode: every `interval_s`, load new models, reload changed ones, unload removed
        ones (a model still being loaded or unloaded is looked at again once it is done)."""
        while True:
            await asyncio.sleep(interval_s)
            present = set(self.scope())
            for name in sorted(present | set(self.statuses)):
                if name in self._appliers:
                    continue
                if name in present:
                    seen = await asyncio.to_thread(fingerprint, self.repository / name)
                    source = self._sources.get(name)
                    if source is not None and source.fingerprint == seen:
                        continue
                    change = DesiredModel(next(self._poll_generations), True)
                elif name in self.queues:
                    change = DesiredModel(next(self._poll_generations), False)
                else:  # removed and not loaded (any more): unloaded, whatever it was before
                    if self.statuses[name].reason != UNLOADED:
                        generation = next(self._poll_generations)
                        self._set(name, ModelStatus([], UNLOADED, UNAVAILABLE, generation))
                    self._sources.pop(name, None)
                    continue
                self._wanted[name] = change
                self._ensure_applier(name)

    # -- transitions --------------------------------------------------------------------------

    def _set(self, name: str, status: ModelStatus) -> None:
        self.statuses[name] = status
        self.on_change()

    async def _load(self, name: str, wanted: DesiredModel) -> None:
        current = self.queues.get(name)
        model_dir = self.repository / name
        seen = await asyncio.to_thread(fingerprint, model_dir) if model_dir.is_dir() else ()
        source = self._sources.get(name)
        plain = not wanted.overridden and not wanted.has_files
        unchanged = source is not None and not source.overridden and source.fingerprint == seen
        if current is not None and plain and unchanged:  # Triton: loading it again is a no-op
            self._set(name, ModelStatus(self._versions(current), None, READY, wanted.generation))
            return
        if current is None:
            self._set(name, ModelStatus([], None, LOADING, self._generation(name)))
        files_dir = (
            self.overrides_dir / f"g{wanted.generation}" / name if wanted.has_files else None
        )
        try:
            entry, instances, device = await self._build(name, wanted, files_dir or model_dir)
        except Exception as exc:  # any failure of a model's files or code is its load's reason
            reason = exc.message if isinstance(exc, ModelConfigError) else f"{exc}"
            log.error("model %r not loaded: %s", name, reason)
            if files_dir is not None:
                shutil.rmtree(files_dir, ignore_errors=True)
            # the directory as seen, so that a poll tries again only once it changes
            if current is not None and source is not None:  # the old one keeps serving
                self._sources[name] = Source(seen, source.overridden, source.files_dir)
                versions = self._versions(current)
                self._set(name, ModelStatus(versions, reason, READY, wanted.generation))
            else:
                self._sources[name] = Source(seen, wanted.overridden or wanted.has_files)
                self._set(name, ModelStatus([], reason, UNAVAILABLE, wanted.generation))
            return
        assert entry.spec is not None
        if entry.spec.kind == ENSEMBLE_KIND:
            self.ensembles[name] = entry
            self._sources[name] = Source(seen, wanted.overridden or wanted.has_files, files_dir)
            self._set(name, ModelStatus(list(entry.versions), None, READY, wanted.generation))
            return
        consumer = f"{self.consumer}/{next(self._consumer_numbers)}"
        queue = self.make_queue(entry.spec, instances, device, consumer)
        self._run(name, queue)
        self._sources[name] = Source(seen, wanted.overridden or wanted.has_files, files_dir)
        versions = sorted(instances)
        self._set(name, ModelStatus(versions, None, READY, wanted.generation))
        log.info("model %r versions %s ready on %s", name, tuple(versions), device)
        if current is not None:
            await self._retire(current)
            if source is not None and source.files_dir is not None:
                shutil.rmtree(source.files_dir, ignore_errors=True)

    async def _build(
        self, name: str, wanted: DesiredModel, model_dir: Path
    ) -> tuple[ModelEntry, dict[int, list[Infer]], torch.device]:
        """The model's entry and instances, from its directory or (`file:` overrides) from the
        private one they are written to; off the event loop."""
        if wanted.has_files:
            files = await read_files(self.redis, name)
            await asyncio.to_thread(_write_files, model_dir, files)
        entry = await asyncio.to_thread(
            scan_model, model_dir, config_json=wanted.config_json, complete=self.complete
        )
        if entry.error or entry.spec is None:
            raise ModelConfigError(entry.error or "no model config")
        if entry.spec.kind == ENSEMBLE_KIND:
            await asyncio.to_thread(check_ensemble, entry, self.repository, self.complete)
            return entry, {}, torch.device("cpu")
        return await asyncio.to_thread(load_model, entry)

    async def _unload(self, name: str, generation: int) -> None:
        queue = self.queues.get(name)
        if queue is None:
            self.ensembles.pop(name, None)
            self._set(name, ModelStatus([], UNLOADED, UNAVAILABLE, generation))
            return
        self._set(name, ModelStatus([], None, UNLOADING, generation))
        if not await self._drained(name, queue, generation):
            return  # a newer load or unload came meanwhile: applied next
        del self.queues[name]
        await self._retire(queue)
        source = self._sources.pop(name, None)
        if source is not None and source.files_dir is not None:
            shutil.rmtree(source.files_dir, ignore_errors=True)
        self._set(name, ModelStatus([], UNLOADED, UNAVAILABLE, generation))
        log.info("model %r unloaded", name)

    async def _drained(self, name: str, queue: ModelQueue, generation: int) -> bool:
        """Wait until the gateways stopped sending and everything queued was run; False if a
        newer desired state came first."""
        settled = time.monotonic() + UNLOAD_SETTLE_S
        limit = time.monotonic() + UNLOAD_DRAIN_LIMIT_S
        while True:
            if self._wanted[name].generation != generation:
                return False
            now = time.monotonic()
            if now >= limit:
                log.warning("%s: requests still arrive after the unload; stopping anyway", name)
                return True
            if now >= settled and queue.state.idle:
                try:
                    if await undelivered(self.redis, queue.streams) == 0:
                        return True
                except REDIS_ERRORS as exc:
                    log.warning("%s: cannot see its streams (%s); still draining", name, exc)
            await asyncio.sleep(DRAIN_CHECK_S)

    async def _retire(self, queue: ModelQueue) -> None:
        """Stop a queue that no longer serves: it finishes what it holds, then what its read
        took but never saw goes back to the streams."""
        queue.stop()
        await asyncio.shield(self._tasks[queue])
        del self._tasks[queue]
        await queue.reader.aclose()
        try:
            await hand_back(self.redis, queue.streams, queue.consumer)
        except REDIS_ERRORS as exc:  # Redis away: a live queue takes them over in time
            log.warning(
                "%s: entries of retired consumer %s left for a takeover after --claim-idle-ms (%s)",
                queue.spec.name,
                queue.consumer,
                exc,
            )

    def _versions(self, queue: ModelQueue) -> list[int]:
        return sorted(queue.instances.by_version)

    def _generation(self, name: str) -> int:
        status = self.statuses.get(name)
        return status.generation if status is not None else 0

    # -- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Every queue stops reading and finishes what it holds."""
        for queue in self.queues.values():
            queue.stop()

    async def wait_stopped(self) -> None:
        """Until every queue has finished (after `stop`)."""
        for task in list(self._appliers.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        for queue in self._tasks:
            await queue.reader.aclose()
        shutil.rmtree(self.overrides_dir, ignore_errors=True)


def _write_files(model_dir: Path, files: Mapping[str, bytes]) -> None:
    """A load's `file:<path>` overrides as a private model directory."""
    shutil.rmtree(model_dir, ignore_errors=True)
    for parameter, content in files.items():
        target = model_dir / override_path(parameter)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    model_dir.mkdir(parents=True, exist_ok=True)
