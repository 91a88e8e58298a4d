"""Hot-path Redis commands sent on connections of their own, past redis-py's per-call layers.

At one request per round trip, redis-py's work around a command costs more than the command: a
pool checkout that probes the socket, retry and observability wrappers, argument handling, a
timer per read, the stream reader and response callbacks (counted with callgrind:
benchmarks/RESULTS.md, "hot-path commands on connections of their own"). A Wire lets redis-py
open its connections (connect, auth, TLS, the RESP3 handshake), then takes over each one's
transport: it writes the RESP that `pack` makes and hiredis parses the replies as they arrive,
in the transport's callback, straight into the waiting call, which spares the client CPU of
redis-py's own read path. Replies come as hiredis gives them: XREAD's is a map under RESP3
(`stream_entries` reads both forms) and stream fields are flat [name, value, ...] lists, which
`sluice.shared.protocol` reads too. A cluster client has no single connection to send on, so there a
Wire goes through the client, which routes each command by its key; a stream read, whose keys
redis-py would ask the server for (COMMAND GETKEYS, twice, on its default node), goes straight
to the node of its first stream. On a Sentinel-managed client, redis-py's connection asks the
sentinels for the master when it connects, so a Wire follows a failover by reconnecting.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import Any, cast

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sluice.shared.redis_client import is_cluster

Command = Sequence[Any]

#: commands with keys redis-py's cluster client cannot find by itself.
_STREAM_READS = frozenset({"XREAD", "XREADGROUP"})

#: arguments longer than this go out as buffers of their own, not copied into the command.
_SEPARATE_BYTES = 16_384


def pack(commands: Sequence[Command]) -> list[bytes | bytearray | memoryview]:
    """RESP for `commands`, as buffers to write in one go.

    redis-py's packer was the worker's largest Python cost per batch at concurrency 1 (a
    publish is the XADD of one result and the finish script with its statistics, dozens of
    arguments); this one takes a fraction of its time (benchmarks/RESULTS.md). Large blobs
    (a batch's tensors) are passed along, not copied.
    """
    buffers: list[bytes | bytearray | memoryview] = []
    parts: list[bytes | bytearray | memoryview] = []
    for command in commands:
        parts.append(b"*%d\r\n" % len(command))
        for arg in command:
            if isinstance(arg, str):
                arg = arg.encode()
            elif isinstance(arg, int):
                arg = b"%d" % arg
            size = arg.nbytes if isinstance(arg, memoryview) else len(arg)
            parts.append(b"$%d\r\n" % size)
            if size > _SEPARATE_BYTES:
                buffers += [b"".join(parts), arg]
                parts = [b"\r\n"]
            else:
                parts += [arg, b"\r\n"]
    buffers.append(b"".join(parts))
    return buffers


def _read_key(command: Command) -> Any:
    """The first stream of an XREAD or XREADGROUP (its keys share one slot); None for
    other commands."""
    name = command[0]
    if (name.decode() if isinstance(name, bytes) else str(name)).upper() not in _STREAM_READS:
        return None
    for index, arg in enumerate(command):
        if arg in ("STREAMS", b"STREAMS"):
            return command[index + 1]
    return None


def stream_entries(reply: Any) -> Iterable[tuple[bytes, list[Any]]]:
    """(stream, entries) of an XREAD or XREADGROUP reply: RESP3 sends a map, RESP2 pairs."""
    if not reply:
        return ()
    return reply.items() if isinstance(reply, dict) else reply


def xadd(stream: str, fields: Mapping[str, Any], *options: Any) -> Command:
    """XADD of `fields` under a new id; `options` (MAXLEN ...) go before the id."""
    return ("XADD", stream, *options, "*", *chain.from_iterable(fields.items()))


_NOT_ENOUGH_DATA = object()


class _Link(asyncio.Protocol):
    """One connection's transport, taken over from redis-py once it is open.

    Calls are answered in the order they were sent; each waits for as many replies as it
    sent commands. Push messages (RESP3) are no call's reply and are dropped.
    """

    def __init__(self, connection: AbstractConnection, timeout_s: float | None) -> None:
        #: kept so that redis-py's stream objects, which close the transport when collected,
        #: live as long as the link
        self._connection = connection
        self._timeout_s = timeout_s
        writer = connection._writer
        assert writer is not None, "the connection is open"
        self._transport: asyncio.WriteTransport = writer.transport
        self._loop = asyncio.get_running_loop()
        # error replies become redis-py's exception classes (LOADING: a connection error)
        self._reader = hiredis.Reader(
            replyError=BaseParser.parse_error, notEnoughData=_NOT_ENOUGH_DATA
        )
        self._calls: deque[tuple[asyncio.Future[list[Any]], int, list[Any]]] = deque()
        self._transport.set_protocol(self)

    async def round_trip(self, buffers: list[Any], count: int) -> list[Any]:
        if self._transport.is_closing():
            raise RedisConnectionError("Connection to Redis closed")
        reply: asyncio.Future[list[Any]] = self._loop.create_future()
        self._calls.append((reply, count, []))
        self._transport.writelines(buffers)
        if self._timeout_s is None:
            return await reply
        timer = self._loop.call_later(self._timeout_s, self._time_out)
        try:
            return await reply
        finally:
            timer.cancel()

    def _time_out(self) -> None:
        self._fail(RedisTimeoutError("Timeout reading from Redis"))
        self._transport.abort()

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while self._calls:
            reply, count, replies = self._calls[0]
            while len(replies) < count:
                value = self._reader.gets()
                if value is _NOT_ENOUGH_DATA:
                    return
                if not isinstance(value, hiredis.PushNotification):
                    replies.append(value)
            self._calls.popleft()
            if not reply.done():
                reply.set_result(replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"Connection to Redis lost: {exc or 'closed by server'}"))

    def _fail(self, error: Exception) -> None:
        calls, self._calls = self._calls, deque()
        for reply, _, _ in calls:
            if not reply.done():
                reply.set_exception(error)

    async def close(self) -> None:
        self._transport.abort()
        await self._connection.disconnect(nowait=True)


class Wire:
    """Commands in one round trip on a connection of this Wire's own (or via a cluster)."""

    def __init__(
        self, client: aioredis.Redis, on_reconnect: Callable[[], None] | None = None
    ) -> None:
        self._client = client
        self._cluster = is_cluster(client)
        #: a cluster client has learned its slots (initialize() has run).
        self._slots_known = False
        self._idle: list[_Link] = []
        #: told when a call is retried on a new connection: Redis may have restarted between
        #: two calls, unseen by the caller
        self._on_reconnect = on_reconnect

    async def execute(self, *commands: Command, raise_on_error: bool = True) -> list[Any]:
        """Each command's reply; an error reply raises once all replies are read, or with
        `raise_on_error=False` takes its command's place among the replies (the commands are
        not a transaction: the others took effect)."""
        if not commands:
            return []
        if self._cluster:
            return await self._through_client(commands, raise_on_error)
        reused = bool(self._idle)
        try:
            return await self._round_trip(commands, raise_on_error)
        except RedisConnectionError:
            if not reused:
                raise
            # kept connections go stale together (Redis restarted, an idle timeout): drop
            # them and try once on a new one, as redis-py retries; a Redis that is down
            # fails that connect at once
            await self.close()
            if self._on_reconnect is not None:
                self._on_reconnect()
            return await self._round_trip(commands, raise_on_error)

    async def _open(self) -> _Link:
        pool = self._client.connection_pool
        connection = pool.make_connection()
        await connection.connect()
        return _Link(connection, pool.connection_kwargs.get("socket_timeout"))

    async def _round_trip(self, commands: Sequence[Command], raise_on_error: bool) -> list[Any]:
        link = self._idle.pop() if self._idle else await self._open()
        try:
            replies = await link.round_trip(pack(commands), len(commands))
        except BaseException:
            # a reply may be left unread: the connection is out of step, never reuse it
            await link.close()
            raise
        for reply in replies:
            if isinstance(reply, ReadOnlyError):
                # a master demoted by a failover: a new connection finds the new master
                await link.close()
                raise RedisConnectionError(f"Redis is a replica now: {reply}")
        self._idle.append(link)
        for reply in replies:
            if raise_on_error and isinstance(reply, RedisError):
                raise reply
        return replies

    async def call(self, *command: Any) -> Any:
        """One command's reply."""
        (reply,) = await self.execute(command)
        return reply

    async def _through_client(self, commands: Sequence[Command], raise_on_error: bool) -> list[Any]:
        if len(commands) == 1:
            key = _read_key(commands[0])
            if key is None:
                try:
                    return [await self._client.execute_command(*commands[0])]
                except ResponseError as exc:
                    if raise_on_error:
                        raise
                    return [exc]
            cluster = cast("AsyncRedisCluster", self._client)
            if not self._slots_known:  # the client's slots, for the node
                await cluster.initialize()
                self._slots_known = True
            node = cluster.get_node_from_key(key)
            return [await cluster.execute_command(*commands[0], target_nodes=node)]
        async with self._client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute(raise_on_error=raise_on_error)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for link in idle:
            await link.close()
