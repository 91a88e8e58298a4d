"""The models a worker serves and the changes between them: load, reload, unload.

Which change to make, and when, is workers/models/model_manager.py's; this makes each one:

- A load builds the model (files read and instances made on a thread, so the loop keeps
  serving) and starts its queue; a reload starts the new queue first, then stops the old one,
  which finishes what it holds while the new one reads what is left in the streams. What the
  old one's cancelled read had taken is handed back (workers/recovery/handoff.py). A failed reload
  leaves the old queue serving, as Triton keeps the old version.
- An unload stops taking new requests at the gateways (they see UNLOADING or the desired
  state) and finishes the requests already queued: the queue keeps reading until the streams
  hold nothing undelivered and at least UNLOAD_SETTLE_S has passed (workers/recovery/retirement.py:
  every gateway has seen the unload by then), runs what it holds, and stops; the model's
  instances are shut down.

Building a model from its files is workers/models/model_build.py's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import Completer
from sluice.shared.redis_client import REDIS_ERRORS, AsyncClient
from sluice.shared.registry import LOADING, READY, UNAVAILABLE, UNLOADING, ModelStatus
from sluice.shared.repository import ModelEntry, fingerprint
from sluice.shared.repository_control import DesiredModel, model_name_problem
from sluice.shared.stats import log_stats_command, stats_record
from sluice.workers.batching.model_queue import ModelQueue
from sluice.workers.models.model_build import (
    ENSEMBLE_KIND,
    Loaded,
    build,
    check_ensemble,
    configure_threads,
    entries_at_start,
    load_model,
)
from sluice.workers.models.override_files import OverrideDirectory
from sluice.workers.recovery.retirement import drained, release

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


class ServedModels:
    """One worker's queues, ensembles and model states, and the loads and unloads between."""

    def __init__(
        self,
        repository: Path,
        consumer: str,
        redis: AsyncClient,
        make_queue: QueueFactory,
        on_change: Callable[[], None],
        overrides: OverrideDirectory,
        complete: Completer | None = None,
    ) -> None:
        self.repository = repository
        self.consumer = consumer
        self.redis = redis
        self.make_queue = make_queue
        self.on_change = on_change
        self.overrides = overrides
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
        self._consumer_numbers = itertools.count(1)

    # -- start -------------------------------------------------------------------------------

    def scan_at_start(self, models: tuple[str, ...] | None, only: set[str] | None) -> list[Loaded]:
        """Load the models to serve from the start (`models`: the worker's `--models`; `only`:
        these, else every one); blocking, run on a thread before the worker serves."""
        entries = entries_at_start(self.repository, models, only, self.complete)
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
                entry, instances, device, warmup = load_model(entry)
            except ModelConfigError as exc:
                log.error("model %r not loaded: %s", entry.name, exc.message)
                self.statuses[entry.name] = ModelStatus([], exc.message)
                continue
            self.statuses[entry.name] = ModelStatus(list(entry.versions), None)
            loaded.append((entry, instances, device, warmup))
            log.info("model %r versions %s ready on %s", entry.name, entry.versions, device)
        return loaded

    async def start(self, loaded: list[Loaded]) -> None:
        """Serve what `scan_at_start` loaded, under the worker's own consumer name."""
        for entry, instances, device, warmup in loaded:
            await self._count_warmup(entry.name, warmup)
            self._run(entry.name, self.make_queue(entry.spec, instances, device, self.consumer))

    async def _count_warmup(self, name: str, increments: list[str | int]) -> None:
        """A model's warm-up runs in its statistics, as Triton counts them, before it is
        ready; a Redis failure costs only these figures."""
        if not increments:
            return
        command = log_stats_command(name, stats_record(increments))
        try:
            await self.redis.execute_command(*command)
        except REDIS_ERRORS as exc:
            log.warning("model %r: warm-up statistics not written: %s", name, exc)

    def _run(self, name: str, queue: ModelQueue) -> None:
        self.queues[name] = queue
        task = asyncio.create_task(queue.run(), name=f"queue:{name}")
        self._tasks[queue] = task
        task.add_done_callback(self._queue_ended)

    def _queue_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None or self.failed.done():
            return
        self.failed.set_exception(task.exception())  # type: ignore[arg-type]

    # -- what a model was built from ------------------------------------------------------------

    def source_fingerprint(self, name: str) -> tuple[tuple[str, int, int], ...] | None:
        """The files a model's queue was built from (as last tried), None if none was."""
        source = self._sources.get(name)
        return source.fingerprint if source is not None else None

    def forget(self, name: str, generation: int) -> None:
        """A model removed from the repository and not loaded (any more): unloaded, whatever
        it was before, and its files no longer watched."""
        if self.statuses[name].reason != UNLOADED:
            self._set(name, ModelStatus([], UNLOADED, UNAVAILABLE, generation))
        self._sources.pop(name, None)

    # -- transitions --------------------------------------------------------------------------

    def _set(self, name: str, status: ModelStatus) -> None:
        self.statuses[name] = status
        self.on_change()

    async def load(self, name: str, wanted: DesiredModel) -> None:
        """Load or reload a model as `wanted` says; a failure is its status's reason."""
        if (problem := model_name_problem(name)) is not None:  # before any filesystem call
            raise ValueError(problem)
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
        files_dir = None
        try:
            if wanted.has_files:
                files_dir = self.overrides.for_load(wanted.generation, name)
            entry, instances, device, warmup = await build(
                self.redis,
                name,
                wanted,
                files_dir or model_dir,
                self.repository,
                self.complete,
                self.overrides,
            )
        except Exception as exc:  # any failure of a model's files or code is its load's reason
            reason = exc.message if isinstance(exc, ModelConfigError) else f"{exc}"
            log.error("model %r not loaded: %s", name, reason)
            self.overrides.discard(files_dir)
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
        await self._count_warmup(name, warmup)
        consumer = f"{self.consumer}/{next(self._consumer_numbers)}"
        queue = self.make_queue(entry.spec, instances, device, consumer)
        self._run(name, queue)
        self._sources[name] = Source(seen, wanted.overridden or wanted.has_files, files_dir)
        versions = sorted(instances)
        self._set(name, ModelStatus(versions, None, READY, wanted.generation))
        log.info("model %r versions %s ready on %s", name, tuple(versions), device)
        if current is not None:
            await self._retire(current)
            if source is not None:
                self.overrides.discard(source.files_dir)

    async def unload(self, name: str, generation: int, superseded: Callable[[], bool]) -> None:
        """Unload a model once what is queued for it has run, unless `superseded` first."""
        queue = self.queues.get(name)
        if queue is None:
            self.ensembles.pop(name, None)
            self._set(name, ModelStatus([], UNLOADED, UNAVAILABLE, generation))
            return
        self._set(name, ModelStatus([], None, UNLOADING, generation))
        if not await drained(self.redis, queue, superseded):
            return  # a newer load or unload came meanwhile: applied next
        del self.queues[name]
        await self._retire(queue)
        source = self._sources.pop(name, None)
        if source is not None:
            self.overrides.discard(source.files_dir)
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
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        for queue in self._tasks:
            await queue.reader.aclose()
        self.overrides.remove_all()
