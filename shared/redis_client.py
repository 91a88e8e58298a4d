"""Redis connections from a URL (`redis://`, `rediss://`, with user and password)."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

#: socket timeouts keep a dead Redis from hanging a request; blocking reads pass their own.
CONNECT_TIMEOUT_S = 2.0


def async_client(url: str, *, socket_timeout_s: float | None = 10.0) -> aioredis.Redis:
    """An asyncio client (hiredis parser when installed) with no response decoding."""
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=socket_timeout_s,
        health_check_interval=0,
    )


def sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=10.0)
