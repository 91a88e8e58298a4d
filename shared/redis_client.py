"""Redis connections from a URL (`redis://`, `rediss://`, `unix://`, with user and password).

`?cluster=true` on a redis:// or rediss:// URL selects a Redis Cluster client (any node of the
cluster as the address): every key sluice uses carries a hash tag, so each command and script
touches one slot and the same code runs on one server or a cluster.

`redis+sentinel://[user:password@]host1:port1,host2:port2/<master-name>[?db=N]` selects the
master that Redis Sentinel names: each new connection asks the sentinels where the master is,
so clients follow a failover by reconnecting (user and password are the master's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sluice.shared.errors import OutOfMemory, Unavailable

#: socket timeouts keep a dead Redis from hanging a request; blocking reads pass their own.
CONNECT_TIMEOUT_S = 2.0
#: how long a command waits for its reply, unless the caller sets its own.
SOCKET_TIMEOUT_S = 10.0
CLUSTER_PARAM = "cluster"
SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379

#: what Redis calls raise when Redis is away: a cluster client raises RedisClusterException,
#: which is not a RedisError, once no node answers.
REDIS_ERRORS = (RedisError, RedisClusterException)
CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, RedisClusterException)

#: a worker's pauses between attempts to read or publish while Redis is unreachable (the last
#: one repeats).
UNREACHABLE_RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.5)

#: how every answer to a write that Redis refused for memory begins.
OUT_OF_MEMORY = "Redis is out of memory (maxmemory)"
#: what a write refused for memory left behind, where the caller does not say more.
UNWRITTEN = "nothing was written"
#: the Retry-After of that answer: room comes back as workers drain the queues.
OUT_OF_MEMORY_RETRY_AFTER_S = 2


def out_of_memory(exc: BaseException) -> bool:
    """Whether Redis refused a write for memory (maxmemory reached, noeviction). Redis 6.2
    reports a refusal inside a script as a plain script error that quotes the OOM reply."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, RedisError) and "-OOM command not allowed" in str(exc)
    )


def redis_failure(
    exc: BaseException, refused: str, unreachable: str, retry_after_s: int | None = None
) -> Unavailable:
    """A failed Redis call as the client's error: OutOfMemory `"<OUT_OF_MEMORY>: <refused>"`
    when Redis refused a write for memory (not an outage: no reconnect mends it), else
    Unavailable `"<unreachable>: <exc>"` with `retry_after_s`."""
    if out_of_memory(exc):
        return OutOfMemory(f"{OUT_OF_MEMORY}: {refused}", OUT_OF_MEMORY_RETRY_AFTER_S)
    return Unavailable(f"{unreachable}: {exc}", retry_after_s)


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


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    """A redis+sentinel:// URL: where the sentinels are, and which master to ask them for."""

    sentinels: list[tuple[str, int]]
    master: str
    #: the master's connection options: db, username, password.
    options: dict[str, Any] = field(default_factory=dict)


def parse_sentinel_url(url: str) -> SentinelTarget | None:
    """The sentinels and master of a redis+sentinel:// URL; None for any other scheme."""
    scheme, _, rest = url.partition("://")
    if scheme != SENTINEL_SCHEME:
        return None
    parts = urlsplit(f"redis://{rest}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels = []
    for address in hosts.split(","):
        host, colon, port = address.rpartition(":")
        if not colon or host.endswith(":"):  # no port, or a bare IPv6 address
            host, port = address, str(DEFAULT_SENTINEL_PORT)
        if not host or not port.isdecimal():
            raise ValueError(f"bad sentinel address {address!r} in {SENTINEL_SCHEME}:// URL")
        sentinels.append((host.strip("[]"), int(port)))
    master = unquote(parts.path.strip("/"))
    if not master:
        raise ValueError(f"{SENTINEL_SCHEME}:// URL names no master: .../<master-name>")
    options: dict[str, Any] = {}
    if userinfo:
        user, colon, password = userinfo.partition(":")
        if colon:
            options["password"] = unquote(password)
        if user:
            options["username"] = unquote(user)
    query = dict(parse_qsl(parts.query))
    if "db" in query:
        if not query["db"].isdecimal():
            raise ValueError(f"db must be a number in {SENTINEL_SCHEME}:// URL")
        options["db"] = int(query["db"])
    return SentinelTarget(sentinels, master, options)


#: sentinels are asked with timeouts whatever the master connection's: a dead one must not
#: hang a connect.
SENTINEL_OPTIONS = {
    "socket_connect_timeout": CONNECT_TIMEOUT_S,
    "socket_timeout": CONNECT_TIMEOUT_S,
}


class _SentinelConnection(redis.sentinel.SentinelManagedConnection):
    """redis-py's sync Sentinel connection keeps a connection whose read was interrupted (a
    signal during a blocking read: rq's warm shutdown) and hands it out of step with its
    replies; a plain connection drops it, and so does this one."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("disconnect_on_error", True)
        return super().read_response(*args, **kwargs)


async def initialized(client: Any) -> None:
    """Let a cluster client learn the cluster before coroutines share it: redis-py's asyncio
    cluster client, first used by many coroutines at once, now and then closes a connection
    under one of them (an AttributeError from its transport, not a Redis error). Redis away:
    the first command learns it instead."""
    if isinstance(client, AsyncRedisCluster):
        with contextlib.suppress(*REDIS_ERRORS):
            await client.initialize()


def async_client(url: str, *, socket_timeout_s: float | None = SOCKET_TIMEOUT_S) -> Any:
    """An asyncio client (hiredis parser when installed) with no response decoding."""
    plain, cluster = split_cluster_flag(url)
    options: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": socket_timeout_s,
    }
    sentinel = parse_sentinel_url(plain)
    if sentinel is not None:
        manager = aiosentinel.Sentinel(sentinel.sentinels, sentinel_kwargs=SENTINEL_OPTIONS)
        return manager.master_for(
            sentinel.master, health_check_interval=0, **options, **sentinel.options
        )
    if cluster:
        return AsyncRedisCluster.from_url(plain, **options)
    return aioredis.Redis.from_url(plain, health_check_interval=0, **options)


def sync_client(url: str) -> Any:
    plain, cluster = split_cluster_flag(url)
    options: dict[str, Any] = {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
    }
    sentinel = parse_sentinel_url(plain)
    if sentinel is not None:
        manager = redis.sentinel.Sentinel(sentinel.sentinels, sentinel_kwargs=SENTINEL_OPTIONS)
        return manager.master_for(
            sentinel.master,
            connection_class=_SentinelConnection,
            **options,
            **sentinel.options,
        )
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
