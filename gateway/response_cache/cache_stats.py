"""Hits and misses of the response cache, added to their models' fleet-wide statistics.

A hit never reaches a worker, so the gateway counts it: each request's figures go into a buffer
that one supervised task writes as a statistics record per model (shared/stats.py), at most
every FLUSH_EVERY_S, so that under load one write carries many requests' figures. Whoever reads
statistics here flushes first, so this gateway's own figures always show; another gateway's
show within FLUSH_EVERY_S.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from sluice.shared.redis_client import REDIS_ERRORS
from sluice.shared.stats import add_increments, log_stats_command, stats_record

log = logging.getLogger(__name__)

#: the longest a figure waits to be written.
FLUSH_EVERY_S = 0.05


class CacheStats:
    def __init__(
        self,
        redis: aioredis.Redis,
        pause: Callable[[], Awaitable[object]] = lambda: asyncio.sleep(FLUSH_EVERY_S),
    ) -> None:
        self.redis = redis
        self._pause = pause
        self._pending: dict[str, dict[str, int]] = {}
        self._wake = asyncio.Event()

    def add(self, model: str, increments: list[str | int]) -> None:
        add_increments(self._pending.setdefault(model, {}), increments)
        self._wake.set()

    async def run(self) -> None:
        """Write figures as they come, until cancelled (a supervised background loop)."""
        while True:
            await self._wake.wait()
            await self._pause()  # more figures join the write
            await self.flush()

    async def flush(self) -> None:
        """Write every figure counted so far (those lost to a Redis failure are logged)."""
        self._wake.clear()
        if not self._pending:
            return
        batch, self._pending = self._pending, {}
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for model, sums in batch.items():
                    record = stats_record([x for pair in sums.items() for x in pair])
                    pipe.execute_command(*log_stats_command(model, record))
                await pipe.execute()
        except REDIS_ERRORS as exc:
            log.warning("response cache statistics of %d models not written: %s", len(batch), exc)
