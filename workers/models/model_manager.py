"""Which change a worker makes to its models, and when, while it serves.

At start the worker loads what its control mode says (every model, or `--load-model`'s). Then
the fleet's desired state (shared/repository_control.py) or, in poll mode, the repository's
own changes drive each model through LOADING, READY, UNLOADING and UNAVAILABLE, one change at
a time per model, reported in the heartbeat with the generation applied. Making each change
(a load, a reload, an unload) is workers/models/served_models.py's.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Mapping
from pathlib import Path

from sluice.shared.redis_client import REDIS_ERRORS
from sluice.shared.repository import fingerprint, model_names
from sluice.shared.repository_control import DesiredModel, model_name_problem
from sluice.workers.models.served_models import ServedModels

log = logging.getLogger(__name__)


class ModelManager:
    """A worker's desired state per model, applied to its served models one change at a time."""

    def __init__(self, served: ServedModels, models: tuple[str, ...] | None) -> None:
        self.served = served
        #: the worker's `--models`: the only ones it serves (None: every one).
        self.models = models
        #: the newest desired state seen per model, and the task applying it.
        self._wanted: dict[str, DesiredModel] = {}
        self._appliers: dict[str, asyncio.Task[None]] = {}
        self._poll_generations = itertools.count(1)
        #: desired states dropped for their names (each said once).
        self._refused: set[str] = set()

    @property
    def repository(self) -> Path:
        return self.served.repository

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
        if name in self.served.queues or (desired is not None and desired.has_files):
            return True
        return (self.repository / name).is_dir()

    def announces(self, name: str) -> bool:
        """Whether this worker's config of the model is current (not behind a newer load)."""
        wanted = self._wanted.get(name)
        status = self.served.statuses.get(name)
        return wanted is None or (status is not None and status.generation == wanted.generation)

    # -- the fleet's desired state ------------------------------------------------------------

    def follow(self, desired: Mapping[str, DesiredModel]) -> None:
        """Apply every desired state this worker has not applied yet (each model in turn)."""
        for name, wanted in desired.items():
            if not self._acceptable(name) or not self.in_scope(name, wanted):
                continue
            status = self.served.statuses.get(name)
            applied = status.generation if status is not None else 0
            if wanted.generation == applied and name not in self._appliers:
                continue
            self._want(name, wanted)

    def _acceptable(self, name: str) -> bool:
        """A desired state stored under a name that is no model directory (written to Redis
        past the gateways' check) is dropped, never applied: said once per name."""
        problem = model_name_problem(name)
        if problem is not None and name not in self._refused:
            self._refused.add(name)
            log.error("desired state of model %r dropped, not applied: %s", name, problem)
        return problem is None

    def _want(self, name: str, wanted: DesiredModel) -> None:
        self._wanted[name] = wanted
        if name not in self._appliers:
            task = asyncio.create_task(self._apply_all(name), name=f"apply:{name}")
            self._appliers[name] = task

    async def _apply_all(self, name: str) -> None:
        try:
            while True:
                wanted = self._wanted[name]
                status = self.served.statuses.get(name)
                if status is not None and status.generation == wanted.generation:
                    return
                if wanted.loaded:
                    await self.served.load(name, wanted)
                else:
                    superseded = functools.partial(self._superseded, name, wanted.generation)
                    await self.served.unload(name, wanted.generation, superseded)
        except REDIS_ERRORS as exc:  # tried again on the next heartbeat
            log.warning("%s: applying its desired state failed: %s", name, exc)
        except Exception:  # a bug: say so, and try again on the next heartbeat
            log.exception("%s: applying its desired state failed", name)
        finally:
            del self._appliers[name]

    def _superseded(self, name: str, generation: int) -> bool:
        return self._wanted[name].generation != generation

    # -- poll mode ------------------------------------------------------------------------------

    async def poll(self, interval_s: float) -> None:
        """Poll mode: every `interval_s`, load new models, reload changed ones, unload removed
        ones (a model still being loaded or unloaded is looked at again once it is done)."""
        while True:
            await asyncio.sleep(interval_s)
            present = set(self.scope())
            for name in sorted(present | set(self.served.statuses)):
                if name in self._appliers:
                    continue
                if name in present:
                    seen = await asyncio.to_thread(fingerprint, self.repository / name)
                    if self.served.source_fingerprint(name) == seen:
                        continue
                    self._want(name, DesiredModel(next(self._poll_generations), True))
                elif name in self.served.queues:
                    self._want(name, DesiredModel(next(self._poll_generations), False))
                else:
                    self.served.forget(name, next(self._poll_generations))

    # -- stop ----------------------------------------------------------------------------------

    async def wait_stopped(self) -> None:
        """Until every queue has finished (after the served models' `stop`); a change being
        applied is abandoned."""
        for task in list(self._appliers.values()):
            task.cancel()
        await self.served.wait_stopped()
