"""Handing a retired model queue's leftovers back to its streams, and watching them drain.

A model queue that stops (a reload swaps in a new one, or an unload) cancels its blocking
read; entries Redis delivered to that read are then pending on the retired queue's consumer
with nobody to run them, and would wait `--claim-idle-ms` for a takeover. Once the retired
queue has answered everything it held, whatever is still pending on its consumer was never
seen by it: each such entry is added again at the stream's tail (its requests keep their
enqueue time), acked and deleted in one script call, so the live queue (or any worker) reads
it at once. Nothing runs twice: the queue that held an entry is gone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from redis.exceptions import ResponseError
from sluice.shared import keys
from sluice.shared.lua import Lua
from sluice.shared.redis_client import AsyncClient

log = logging.getLogger(__name__)

#: leftovers handed back per round trip.
BATCH = 256

#: re-add each entry with its fields, then ack and delete the original.
REQUEUE = Lua(
    """
local moved = 0
for i = 2, #ARGV do
  local found = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
  if found[1] then
    redis.call('XADD', KEYS[1], '*', unpack(found[1][2]))
    moved = moved + 1
  end
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  redis.call('XDEL', KEYS[1], ARGV[i])
end
return moved
"""
)


async def hand_back(redis: AsyncClient, streams: Iterable[str], consumer: str) -> int:
    """Requeue what is pending on a retired `consumer`, then drop it from the group."""
    moved = 0
    for stream in streams:
        while True:
            pending: list[Any] = await redis.xpending_range(
                stream, keys.WORKER_GROUP, min="-", max="+", count=BATCH, consumername=consumer
            )
            if not pending:
                break
            ids = [p["message_id"] for p in pending]
            moved += int(await REQUEUE.run(redis, [stream], [keys.WORKER_GROUP, *ids]))
        try:
            await redis.xgroup_delconsumer(stream, keys.WORKER_GROUP, consumer)
        except ResponseError as exc:  # no such group: Redis lost it, nothing pending then
            log.debug("%s: consumer %s not removed: %s", stream, consumer, exc)
    if moved:
        log.info("handed %d entries of retired consumer %s back to their streams", moved, consumer)
    return moved


async def undelivered(redis: AsyncClient, streams: Iterable[str]) -> int:
    """Entries of `streams` no worker has read yet (acked entries are deleted, so the
    stream's length less what is pending in the group)."""
    total = 0
    for stream in streams:
        length = int(await redis.xlen(stream))
        if not length:
            continue
        try:
            groups = await redis.xinfo_groups(stream)
        except ResponseError:
            total += length
            continue
        group = next((g for g in groups if _text(g["name"]) == keys.WORKER_GROUP), {"pending": 0})
        total += max(0, length - int(group.get("pending") or 0))
    return total


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
