"""Triton's `redis` cache: one cache for the whole fleet, so that a response any worker
computed serves every gateway.

A lookup is one GET, an insert one SET with a TTL, made before the miss is answered (as Triton
inserts before it responds), so that the client's next request hits at any gateway. Both go on
connections of their own past redis-py's per-call layers (shared/redis_wire.py), as the
request path's other commands do. When Redis
fails, a lookup is a miss and an insert is skipped: the request is served uncached, as Triton
serves it.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from sluice.shared.keys import PREFIX
from sluice.shared.redis_client import REDIS_ERRORS
from sluice.shared.redis_wire import Wire

log = logging.getLogger(__name__)


def cache_key(digest: bytes) -> str:
    """An entry's key: no hash tag, so that entries spread over a Redis Cluster's shards."""
    return f"{PREFIX}:cache:{digest.hex()}"


class RedisStore:
    def __init__(self, redis: aioredis.Redis, ttl_s: int, max_entry_bytes: int) -> None:
        self.wire = Wire(redis)
        self.ttl_s = ttl_s
        self.max_entry_bytes = max_entry_bytes

    async def get(self, key: bytes) -> bytes | None:
        try:
            entry = await self.wire.call("GET", cache_key(key))
        except REDIS_ERRORS as exc:
            log.warning("response cache lookup failed, serving uncached: %s", exc)
            return None
        return entry if isinstance(entry, bytes) else None

    async def put(self, key: bytes, entry: bytes) -> None:
        """Keep `entry` for the TTL; one larger than `max_entry_bytes` goes uncached."""
        if len(entry) > self.max_entry_bytes:
            return
        try:
            await self.wire.call("SET", cache_key(key), entry, "EX", self.ttl_s)
        except REDIS_ERRORS as exc:
            log.warning("response cache insert failed: %s", exc)
