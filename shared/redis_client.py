"""Redis connections from a URL (`redis://`, `rediss://`, `unix://`, with user and password).

`?cluster=true` on a redis:// or rediss:// URL selects a Redis Cluster client (any node of the
cluster as the address): every key sluice uses carries a hash tag, so each command and script
touches one slot and the same code runs on one server or a cluster.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

#: socket timeouts keep a dead Redis from hanging a request; blocking reads pass their own.
CONNECT_TIMEOUT_S = 2.0
CLUSTER_PARAM = "cluster"

#: what Redis calls raise when Redis is away: a cluster client raises RedisClusterException,
#: which is not a RedisError, once no node answers.
REDIS_ERRORS = (RedisError, RedisClusterException)
CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, RedisClusterException)

#: either kind of asyncio client; both take the same commands for single-slot work.
AsyncClient = aioredis.Redis | AsyncRedisCluster


def split_cluster_flag(url: str) -> tuple[str, bool]:
    """The URL without `cluster=...`, and whether it asked for a cluster client."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    flags = [v for k, v in query if k == CLUSTER_PARAM]
    if not flags:
        return url, False
    rest = urlencode([(k, v) for k, v in query if k != CLUSTER_PARAM])
    return urlunsplit(parts._replace(query=rest)), flags[-1].lower() in ("1", "true", "yes")


def async_client(url: str, *, socket_timeout_s: float | None = 10.0) -> Any:
    """An asyncio client (hiredis parser when installed) with no response decoding."""
    plain, cluster = split_cluster_flag(url)
    options: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": socket_timeout_s,
    }
    if cluster:
        return AsyncRedisCluster.from_url(plain, **options)
    return aioredis.Redis.from_url(plain, health_check_interval=0, **options)


def sync_client(url: str) -> Any:
    plain, cluster = split_cluster_flag(url)
    options = {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_timeout": 10.0}
    if cluster:
        return RedisCluster.from_url(plain, **options)
    return redis.Redis.from_url(plain, **options)


def is_cluster(client: Any) -> bool:
    return isinstance(client, AsyncRedisCluster | RedisCluster)


async def server_info(client: Any, key: str, section: str) -> dict[str, Any]:
    """INFO of the server that holds `key` (on a cluster: that slot's primary)."""
    if isinstance(client, AsyncRedisCluster):
        await client.initialize()  # learns the slot map (a no-op once done)
        node = client.get_node_from_key(key)
        return dict(await client.info(section, target_nodes=node))
    return dict(await client.info(section))
