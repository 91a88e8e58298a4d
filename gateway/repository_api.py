"""Triton's model repository extension at a gateway: the fleet's repository index, and loads
and unloads that reach every worker (explicit model control only, as Triton answers)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from sluice.gateway import metadata
from sluice.gateway.model_table import ModelTable
from sluice.gateway.outage import RETRY_AFTER_S
from sluice.shared.config_view import ConfigView
from sluice.shared.errors import Unavailable
from sluice.shared.model_loads import (
    check_load,
    failed_to_poll,
    load_composing,
    load_fleet_wide,
    unload_fleet_wide,
)
from sluice.shared.redis_client import REDIS_ERRORS
from sluice.shared.repository_control import NOT_EXPLICIT, ControlMode


class ControlLimits(Protocol):
    """What bounds a load (the gateway's limits)."""

    @property
    def model_control_mode(self) -> ControlMode: ...
    @property
    def request_timeout_s(self) -> float: ...
    @property
    def max_override_models(self) -> int: ...


async def refreshed(table: ModelTable) -> None:
    """The model table read again from Redis (Unavailable while Redis is unreachable)."""
    try:
        await table.refresh()
    except REDIS_ERRORS as exc:
        message = f"queue unavailable: Redis is unreachable ({exc})"
        raise Unavailable(message, RETRY_AFTER_S) from None


class RepositoryControl:
    def __init__(self, redis: Any, table: ModelTable, limits: ControlLimits) -> None:
        self.redis = redis
        self.table = table
        self.limits = limits

    async def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Triton's repository index of the fleet (`ready_only`: READY versions only)."""
        await refreshed(self.table)
        return metadata.repository_index(self.table.models, self.table.repository, ready_only)

    async def load_model(
        self, name: str, config_json: str | None = None, files: Mapping[str, bytes] | None = None
    ) -> None:
        """Load (or reload) the model on every worker that serves it; returns once it is READY
        on one, fails with the workers' reasons if none could (see shared/model_loads.py).
        An ensemble's composing models not ready yet are loaded too, nested ones' as well, as
        Triton does."""
        self._explicit_only()
        check_load(name, config_json, files)
        await refreshed(self.table)
        if not files and name not in self.table.repository:
            raise failed_to_poll(name)
        timeout_s, most = self.limits.request_timeout_s, self.limits.max_override_models
        await load_fleet_wide(self.redis, name, config_json, files, timeout_s, most)
        await load_composing(self.redis, name, self._look, timeout_s, most)

    async def _look(self, name: str) -> tuple[ConfigView | None, bool]:
        """The model as this gateway serves it once its table is fresh: its config (here at
        once, as of a load just made) and whether it is ready."""
        await refreshed(self.table)
        view = self.table.models.get(name)
        return (view.config, view.ready) if view is not None else (None, False)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Unload the model fleet-wide; returns at once (Triton's UNLOADING), the workers finish
        the requests already queued and then report it UNAVAILABLE "unloaded".
        With `unload_dependents` an ensemble's composing models (nested ones' too) go as well;
        without, they stay loaded."""
        self._explicit_only()
        await refreshed(self.table)
        if name not in self.table.repository and name not in self.table.models:
            return  # nothing to unload, as Triton answers
        config_of = self.table.config_of
        for model in await unload_fleet_wide(self.redis, name, unload_dependents, config_of):
            self.table.withdraw(model)

    def _explicit_only(self) -> None:
        if self.limits.model_control_mode != "explicit":
            raise Unavailable(NOT_EXPLICIT)
