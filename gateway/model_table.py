"""The gateway's view of the models the fleet serves, refreshed from Redis every second.

One pipelined round trip per refresh also carries this gateway's own heartbeat, so keeping
the view fresh costs a few commands a second whatever the load.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from sluice.shared import keys
from sluice.shared.config_view import ConfigView
from sluice.shared.errors import ModelNotFound, ModelNotReady
from sluice.shared.queue_policy import QueuePolicy
from sluice.shared.redis_client import REDIS_ERRORS
from sluice.shared.registry import (
    HEARTBEAT_INTERVAL_S,
    LOADING,
    READY,
    UNAVAILABLE,
    UNLOADING,
    Member,
    ModelRecord,
    live_members,
    now_ms,
)
from sluice.shared.repository_control import ControlMode, DesiredModel, decode_all
from sluice.shared.signature import Signature
from sluice.shared.when_full import past_maxmemory

log = logging.getLogger(__name__)

#: how often an unreachable Redis is tried again.
RETRY_INTERVAL_S = 0.1
#: how long the reply stream of a silent gateway lives on.
REPLY_STREAM_TTL_S = 3600
#: the reason a model unloaded on purpose is unavailable for (Triton's).
UNLOADED = "unloaded"
#: of the workers' states for a model, the one the index shows when no version is ready.
STATE_ORDER = (LOADING, UNLOADING, UNAVAILABLE)
#: the queue policy of a model with no config: one queue, no limits.
NO_QUEUE_POLICY = QueuePolicy()


def no_versions(name: str) -> ModelNotFound:
    """Triton's answer (404, NOT_FOUND) to a request for a model with no version to serve it."""
    return ModelNotFound(f"Request for unknown model: '{name}' has no available versions")


@dataclass
class ModelView:
    name: str
    #: None: no worker could load it (`reason` says why).
    config: ConfigView | None
    signature: Signature | None
    versions: list[int]
    ready_versions: set[int] = field(default_factory=set)
    reason: str | None = None
    #: the workers' state of it when no version is ready: LOADING, UNLOADING or UNAVAILABLE.
    state: str = UNAVAILABLE
    #: unloaded on purpose (an unload call, or removed from a polled repository): requests
    #: are refused rather than queued for a worker to come.
    withdrawn: bool = False

    @property
    def ready(self) -> bool:
        return bool(self.ready_versions) and not self.withdrawn

    @property
    def queue_policy(self) -> QueuePolicy:
        return self.config.queue_policy if self.config is not None else NO_QUEUE_POLICY

    @property
    def partitions(self) -> int:
        return self.config.partitions if self.config is not None else 1

    @property
    def is_ensemble(self) -> bool:
        return self.config is not None and self.config.is_ensemble

    @property
    def preserve_ordering(self) -> bool:
        return self.config is not None and self.config.preserve_ordering

    def resolve_version(self, requested: str | None) -> int:
        """0 means "whatever the worker serves as latest"; a named version must be ready."""
        if self.withdrawn:
            raise no_versions(self.name)
        if requested is None:
            if self.signature is None:
                raise ModelNotReady(f"model '{self.name}' is not ready: {self.reason}")
            return 0
        version = int(requested)
        if version not in self.versions or self.signature is None:
            raise ModelNotFound(
                f"Request for unknown model: '{self.name}' version {version} is not found"
            )
        return version


def _nothing(*_: object) -> None:
    return None


def _always() -> bool:
    return True


class ModelTable:
    def __init__(
        self,
        redis: aioredis.Redis,
        gateway_id: str,
        inflight: Callable[[], dict[str, int]],
        *,
        control_mode: ControlMode = "none",
        on_unloaded: Callable[[str], None] = _nothing,
        on_depths: Callable[[str, int, list[int], int], None] = _nothing,
        background_up: Callable[[], bool] = _always,
    ) -> None:
        """`control_mode`: Triton's --model-control-mode; `on_unloaded`: called with the name
        of each model unloaded everywhere, at every refresh (no worker will read what is
        still queued for it); `on_depths`: called at every heartbeat with the entries in each
        partition of a partitioned model's level, and its batch size (model, level, depths,
        batch); `background_up`: whether the gateway's background loops run
        (gateway/background.py): while one is down after a failure, the gateway is not
        ready."""
        self.redis = redis
        self.gateway_id = gateway_id
        self.inflight = inflight
        self.models: dict[str, ModelView] = {}
        self.members: list[Member] = []
        #: the fleet's desired state per model (explicit mode's loads and unloads).
        self.desired: dict[str, DesiredModel] = {}
        #: the models some live worker's repository holds, loaded or not.
        self.repository: set[str] = set()
        #: whether the gateway may be ready with no model loaded (explicit and poll modes).
        self.empty_ok = control_mode != "none"
        #: explicit mode: loads and unloads follow the desired state (other modes ignore what
        #: an earlier explicit fleet left in Redis).
        self.follows_desired = control_mode == "explicit"
        self.refreshed = asyncio.Event()
        self.on_unloaded = on_unloaded
        self.on_depths = on_depths
        self.background_up = background_up
        self._last_ok_s = 0.0
        self._reachable = False

    def config_of(self, name: str) -> ConfigView | None:
        """The config of a model of the table (None: unknown, or none loaded)."""
        view = self.models.get(name)
        return view.config if view is not None else None

    def get(self, name: str) -> ModelView:
        view = self.models.get(name)
        if view is None:
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
        return view

    @property
    def ready(self) -> bool:
        """Redis reachable, the background loops running, and every model that loaded somewhere
        (and was not unloaded on purpose) has a ready instance; with no such model, ready if one
        was unloaded on purpose, or (explicit and poll modes) if a worker is there."""
        servable = [m for m in self.models.values() if m.config is not None and not m.withdrawn]
        if not (self.reachable and self.background_up()) or not all(m.ready for m in servable):
            return False
        if servable:
            return True
        workers = any(m.kind == "worker" for m in self.members)
        return any(m.withdrawn for m in self.models.values()) or (self.empty_ok and workers)

    @property
    def reachable(self) -> bool:
        """False from the first failed refresh until one succeeds: the gateway then reports
        not ready, so that balancers prefer others while it holds its requests."""
        return self._reachable and time.monotonic() - self._last_ok_s < 3 * HEARTBEAT_INTERVAL_S

    async def refresh(self) -> None:
        me = Member(
            self.gateway_id,
            "gateway",
            socket.gethostname(),
            os.getpid(),
            now_ms(),
            info={"inflight": self.inflight()},
        )
        async with self.redis.pipeline(transaction=False) as pipe:
            # a full Redis still takes it (shared/when_full.py); the rest are reads
            pipe.execute_command(*past_maxmemory("HSET", keys.FLEET, self.gateway_id, me.encode()))
            pipe.expire(keys.reply_stream(self.gateway_id), REPLY_STREAM_TTL_S)
            pipe.hgetall(keys.MODELS)
            pipe.hgetall(keys.FLEET)
            pipe.hgetall(keys.DESIRED)
            _, _, models_raw, fleet_raw, desired_raw = await pipe.execute()
            members, stale = live_members(fleet_raw, now_ms())
            if stale:
                await self.redis.hdel(keys.FLEET, *stale)
            self.members = members
            self.desired = decode_all(desired_raw) if self.follows_desired else {}
            self.repository = {n for m in members if m.kind == "worker" for n in m.repository}
            # none at all: a Redis that restarted empty, and its workers announce their models
            # again within a heartbeat; until then requests for them are queued, not refused
            if models_raw or not self.models:
                self.models = self._views(models_raw, members, self.desired)
            for view in self.models.values():
                if view.withdrawn and view.state == UNAVAILABLE:
                    self.on_unloaded(view.name)
            self._last_ok_s = time.monotonic()
            self._reachable = True
            self.refreshed.set()

    def withdraw(self, name: str) -> None:
        """This gateway unloaded the model: refuse its requests now, not from the next refresh."""
        view = self.models.get(name)
        if view is not None:
            view.withdrawn = True
            view.ready_versions.clear()
            view.state, view.reason = UNLOADING, None

    @staticmethod
    def _views(
        models_raw: dict[bytes, bytes], members: list[Member], desired: dict[str, DesiredModel]
    ) -> dict[str, ModelView]:
        views: dict[str, ModelView] = {}
        for raw_name, blob in models_raw.items():
            name = raw_name.decode()
            record = ModelRecord.decode(blob)
            config = record.config
            views[name] = ModelView(
                name,
                config,
                config.signature if config is not None else None,
                record.versions,
                reason=record.error,
            )
        states: dict[str, set[str]] = {}
        for member in members:
            for name, status in member.models.items():
                view = views.get(name)
                if view is None:
                    continue
                state = status.current_state
                states.setdefault(name, set()).add(state)
                if state == READY:
                    view.ready_versions.update(status.ready_versions)
                elif status.reason and not view.ready_versions:
                    view.reason = status.reason
        for name, view in views.items():
            seen = states.get(name, set())
            wanted = desired.get(name)
            unloaded = READY not in seen and (UNLOADING in seen or view.reason == UNLOADED)
            view.withdrawn = (wanted is not None and not wanted.loaded) or unloaded
            if view.withdrawn:
                view.ready_versions.clear()
            view.state = next((s for s in STATE_ORDER if s in seen), UNAVAILABLE)
            if view.withdrawn and READY in seen:  # some worker has yet to apply the unload
                view.state = UNLOADING
            if view.ready_versions or view.state in (LOADING, UNLOADING):
                view.reason = None
            elif view.reason is None:
                view.reason = UNLOADED if view.withdrawn else "no live worker serves it"
        return views

    async def run(self) -> None:
        """Refresh forever; an unreachable Redis marks the gateway not ready until it is back."""
        while True:
            try:
                await self.refresh()
                await self._observe_partitions()
            except REDIS_ERRORS as exc:
                if self._reachable:
                    log.warning("Redis unreachable: %s", exc)
                self._reachable = False
            # while Redis is away, look again soon: readiness comes back with it
            await asyncio.sleep(HEARTBEAT_INTERVAL_S if self._reachable else RETRY_INTERVAL_S)

    async def _observe_partitions(self) -> None:
        """How deep each partition of the partitioned models is (shared/partitions.py)."""
        split = [
            (v, lv)
            for v in self.models.values()
            if v.partitions > 1
            for lv in v.queue_policy.levels
        ]
        if not split:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for view, level in split:
                for partition in range(view.partitions):
                    pipe.xlen(keys.request_stream(view.name, level, partition))
            depths = iter(await pipe.execute())
        for view, level in split:
            batch = max(1, view.config.max_batch_size) if view.config is not None else 1
            self.on_depths(view.name, level, [next(depths) for _ in range(view.partitions)], batch)

    async def remove_self(self) -> None:
        try:
            await self.redis.hdel(keys.FLEET, self.gateway_id)
        except REDIS_ERRORS as exc:
            log.warning("could not remove fleet entry: %s", exc)
