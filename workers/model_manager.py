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
  hold nothing undelivered and at least UNLOAD_SETTLE_S has passed (workers/retirement.py:
  every gateway has seen the unload by then), runs what it holds, and stops; the model's
  instances are shut down.

Building a model from its files is workers/model_build.py's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import Completer
from sluice.shared.redis_client import REDIS_ERRORS, AsyncClient
from sluice.shared.registry import (
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
)
from sluice.shared.repository_control import DesiredModel
from sluice.workers.model_build import (
    ENSEMBLE_KIND,
    Loaded,
    build,
    check_ensemble,
    configure_threads,
    entries_at_start,
    load_model,
)
from sluice.workers.model_queue import ModelQueue
from sluice.workers.retirement import drained, release

log = logging.getLogger(__name__)

#: the reason an unloaded model is UNAVAILABLE for (Triton's).
UNLOADED = "unloaded"

#: builds a model's queue: spec, instances per version, device, consumer name.
QueueFactory = Callable[..., ModelQueue]


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

    def scan_at_start(self, only: set[str] | None) -> list[Loaded]:
        """Load the models to serve from the start (`only`: these, else every one); blocking,
        run on a thread before the worker serves."""
        entries = entries_at_start(self.repository, self.models, only, self.complete)
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

    def start(self, loaded: list[Loaded]) -> None:
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
            entry, instances, device = await build(
                self.redis, name, wanted, files_dir or model_dir, self.repository, self.complete
            )
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

    async def _unload(self, name: str, generation: int) -> None:
        queue = self.queues.get(name)
        if queue is None:
            self.ensembles.pop(name, None)
            self._set(name, ModelStatus([], UNLOADED, UNAVAILABLE, generation))
            return
        self._set(name, ModelStatus([], None, UNLOADING, generation))
        if not await drained(self.redis, queue, lambda: self._superseded(name, generation)):
            return  # a newer load or unload came meanwhile: applied next
        del self.queues[name]
        await self._retire(queue)
        source = self._sources.pop(name, None)
        if source is not None and source.files_dir is not None:
            shutil.rmtree(source.files_dir, ignore_errors=True)
        self._set(name, ModelStatus([], UNLOADED, UNAVAILABLE, generation))
        log.info("model %r unloaded", name)

    async def _retire(self, queue: ModelQueue) -> None:
        """Stop a queue that no longer serves: it finishes what it holds, then what its read
        took but never saw goes back to the streams."""
        queue.stop()
        await asyncio.shield(self._tasks[queue])
        del self._tasks[queue]
        await release(self.redis, queue)

    def _versions(self, queue: ModelQueue) -> list[int]:
        return sorted(queue.instances.by_version)

    def _superseded(self, name: str, generation: int) -> bool:
        return self._wanted[name].generation != generation

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
