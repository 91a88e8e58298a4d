"""The gateway's view of the models the fleet serves, refreshed from Redis every second.

One pipelined round trip per refresh also carries this gateway's own heartbeat, so keeping
the view fresh costs a few commands a second whatever the load.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from sluice.shared import keys
from sluice.shared.errors import ModelNotFound, ModelNotReady
from sluice.shared.queue_policy import QueuePolicy
from sluice.shared.redis_client import REDIS_ERRORS
from sluice.shared.registry import (
    HEARTBEAT_INTERVAL_S,
    Member,
    decode_model_record,
    live_members,
    now_ms,
)
from sluice.shared.signature import Signature

log = logging.getLogger(__name__)

#: how often an unreachable Redis is tried again.
RETRY_INTERVAL_S = 0.1
#: how long the reply stream of a silent gateway lives on.
REPLY_STREAM_TTL_S = 3600


@dataclass
class ModelView:
    name: str
    config: dict[str, Any] | None
    signature: Signature | None
    versions: list[int]
    ready_versions: set[int] = field(default_factory=set)
    reason: str | None = None

    @property
    def ready(self) -> bool:
        return bool(self.ready_versions)

    @functools.cached_property
    def queue_policy(self) -> QueuePolicy:
        return QueuePolicy.from_config(self.config or {})

    @property
    def preserve_ordering(self) -> bool:
        batching = (self.config or {}).get("dynamic_batching") or {}
        return bool(batching.get("preserve_ordering"))

    def resolve_version(self, requested: str | None) -> int:
        """0 means "whatever the worker serves as latest"; a named version must be ready."""
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


class ModelTable:
    def __init__(
        self, redis: aioredis.Redis, gateway_id: str, inflight: Callable[[], dict[str, int]]
    ) -> None:
        self.redis = redis
        self.gateway_id = gateway_id
        self.inflight = inflight
        self.models: dict[str, ModelView] = {}
        self.members: list[Member] = []
        self.refreshed = asyncio.Event()
        self._last_ok = 0.0
        self._reachable = False

    def get(self, name: str) -> ModelView:
        view = self.models.get(name)
        if view is None:
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
        return view

    @property
    def ready(self) -> bool:
        """Redis reachable and every model that loaded somewhere has a ready instance."""
        servable = [m for m in self.models.values() if m.config is not None]
        return self.reachable and bool(servable) and all(m.ready for m in servable)

    @property
    def reachable(self) -> bool:
        """False from the first failed refresh until one succeeds: the gateway then reports
        not ready, so that balancers prefer others while it holds its requests."""
        return self._reachable and time.monotonic() - self._last_ok < 3 * HEARTBEAT_INTERVAL_S

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
            pipe.hset(keys.FLEET, self.gateway_id, me.encode())
            pipe.expire(keys.reply_stream(self.gateway_id), REPLY_STREAM_TTL_S)
            pipe.hgetall(keys.MODELS)
            pipe.hgetall(keys.FLEET)
            _, _, models_raw, fleet_raw = await pipe.execute()
            members, stale = live_members(fleet_raw, now_ms())
            if stale:
                await self.redis.hdel(keys.FLEET, *stale)
            self.members = members
            # none at all: a Redis that restarted empty, and its workers announce their models
            # again within a heartbeat; until then requests for them are queued, not refused
            if models_raw or not self.models:
                self.models = self._views(models_raw, members)
            self._last_ok = time.monotonic()
            self._reachable = True
            self.refreshed.set()

    @staticmethod
    def _views(models_raw: dict[bytes, bytes], members: list[Member]) -> dict[str, ModelView]:
        views: dict[str, ModelView] = {}
        for raw_name, blob in models_raw.items():
            name = raw_name.decode()
            record = decode_model_record(blob)
            config = record["config"]
            views[name] = ModelView(
                name,
                config,
                Signature.from_config(config) if config else None,
                list(record["versions"]),
                reason=record["error"],
            )
        for member in members:
            for name, status in member.models.items():
                view = views.get(name)
                if view is None:
                    continue
                view.ready_versions.update(status.ready_versions)
                if status.reason and not view.ready:
                    view.reason = status.reason
        for view in views.values():
            if view.ready:
                view.reason = None
            elif view.reason is None:
                view.reason = "no live worker serves it"
        return views

    async def run(self) -> None:
        """Refresh forever; an unreachable Redis marks the gateway not ready until it is back."""
        while True:
            try:
                await self.refresh()
            except REDIS_ERRORS as exc:
                if self._reachable:
                    log.warning("Redis unreachable: %s", exc)
                self._reachable = False
            # while Redis is away, look again soon: readiness comes back with it
            await asyncio.sleep(HEARTBEAT_INTERVAL_S if self._reachable else RETRY_INTERVAL_S)

    async def remove_self(self) -> None:
        try:
            await self.redis.hdel(keys.FLEET, self.gateway_id)
        except REDIS_ERRORS as exc:
            log.warning("could not remove fleet entry: %s", exc)
