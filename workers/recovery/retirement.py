"""A model queue leaving service: an unload waits for its streams to drain, and a retired
queue's reader is closed and its unseen entries handed back (workers/recovery/handoff.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sluice.shared.redis_client import REDIS_ERRORS, AsyncClient
from sluice.shared.registry import HEARTBEAT_INTERVAL_S
from sluice.workers.batching.model_queue import ModelQueue
from sluice.workers.recovery.handoff import hand_back, undelivered

log = logging.getLogger(__name__)

#: an unloading model keeps serving at least this long: gateways refresh their view of the
#: fleet every heartbeat, so by then none sends it new requests.
UNLOAD_SETTLE_S = 2 * HEARTBEAT_INTERVAL_S
#: an unload stops the queue after this long even if requests still arrive.
UNLOAD_DRAIN_LIMIT_S = 30.0
#: how often an unloading queue looks whether its streams are drained.
DRAIN_CHECK_S = 0.05


async def drained(redis: AsyncClient, queue: ModelQueue, superseded: Callable[[], bool]) -> bool:
    """Wait until the gateways stopped sending and everything queued was run; False if a
    newer desired state came first (`superseded`)."""
    name = queue.spec.name
    settled_s = time.monotonic() + UNLOAD_SETTLE_S
    limit_s = time.monotonic() + UNLOAD_DRAIN_LIMIT_S
    while True:
        if superseded():
            return False
        now_s = time.monotonic()
        if now_s >= limit_s:
            log.warning("%s: requests still arrive after the unload; stopping anyway", name)
            return True
        if now_s >= settled_s and queue.state.idle:
            try:
                if await undelivered(redis, queue.streams) == 0:
                    return True
            except REDIS_ERRORS as exc:
                log.warning("%s: cannot see its streams (%s); still draining", name, exc)
        await asyncio.sleep(DRAIN_CHECK_S)


async def release(redis: AsyncClient, queue: ModelQueue) -> None:
    """A stopped queue's reader closed, and what its read took but never saw back on the
    streams."""
    await queue.reader.aclose()
    try:
        await hand_back(redis, queue.streams, queue.consumer)
    except REDIS_ERRORS as exc:  # Redis away: a live queue takes them over in time
        log.warning(
            "%s: entries of retired consumer %s left for a takeover after --claim-idle-ms (%s)",
            queue.spec.name,
            queue.consumer,
            exc,
        )
