"""Triton's logging extension at the gateway: `/v2/logging` and gRPC `LogSettings` read and
change the fleet's logging settings (shared/log_settings.py); every gateway and worker
follows them (shared/log_control.py), this gateway at once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.shared import keys
from sluice.shared.log_control import LogControl
from sluice.shared.log_settings import LogSettings, LogSettingsError


class FleetLogging:
    def __init__(self, redis: Any, control: LogControl) -> None:
        self.redis = redis
        self.control = control

    async def current(self) -> LogSettings:
        """This gateway's settings under the fleet's, as they are in Redis now."""
        return self.control.under_fleet(await self.redis.hgetall(keys.LOG_SETTINGS))

    async def update(
        self, changes: Mapping[str, Any]
    ) -> tuple[LogSettings, LogSettingsError | None]:
        """Apply `changes` fleet-wide as Triton applies them (up to the first it refuses);
        the settings after, and that refusal. Only the fields changed are written, so two
        gateways changing different fields at once both take effect."""
        current = await self.current()
        settings, refused = current.updated(changes)
        fields = settings.fleet_fields(current)
        if fields:
            await self.redis.hset(keys.LOG_SETTINGS, mapping=fields)
            self.control.apply(settings)
        return settings, refused
