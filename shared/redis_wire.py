"""Hot-path Redis commands sent on connections of their own, past redis-py's per-call layers.

At one request per round trip, redis-py's work around a command costs more than the command:
a pool checkout that probes the socket, retry and observability wrappers, argument handling
and response callbacks. Counted with callgrind on uvloop (redis-py 8.1): an XREAD round trip
takes 300k instructions through the client and 163k straight on a connection, XADD 275k
against 164k, a two-command pipeline 442k against 248k. A Wire writes the RESP that `pack`
makes on redis-py's own connection class (its hiredis parser, connect, auth, TLS and
timeouts) and keeps its idle connections for the next call. Replies come as the parser
gives them: XREAD's is a map under RESP3 (`stream_entries` reads both forms) and stream
fields are flat [name, value, ...] lists, which `shared.protocol` reads too. A cluster
client has no single connection to send on, so there a Wire goes through the client, which
routes each command by its key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import chain
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from shared.redis_client import is_cluster

Command = Sequence[Any]

#: arguments longer than this go out as buffers of their own, not copied into the command.
_SEPARATE_BYTES = 16_384


def pack(commands: Sequence[Command]) -> list[bytes | bytearray | memoryview]:
    """RESP for `commands`, as buffers to write in one go.

    redis-py's packer takes 76-115 µs for a publish (the XADD of one result and the finish
    script with its statistics, 59 arguments) against 26-34 µs here (2-core VM, 3 runs):
    it was the worker's largest Python cost per batch at c=1. Large blobs (a batch's
    tensors) are passed along, not copied.
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


def stream_entries(reply: Any) -> Iterable[tuple[bytes, list[Any]]]:
    """(stream, entries) of an XREAD or XREADGROUP reply: RESP3 sends a map, RESP2 pairs."""
    if not reply:
        return ()
    return reply.items() if isinstance(reply, dict) else reply


def xadd(stream: str, fields: Mapping[str, Any], *options: Any) -> Command:
    """XADD of `fields` under a new id; `options` (MAXLEN ...) go before the id."""
    return ("XADD", stream, *options, "*", *chain.from_iterable(fields.items()))


class Wire:
    """Commands in one round trip on a connection of this Wire's own (or via a cluster)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._cluster = is_cluster(client)
        self._idle: list[AbstractConnection] = []

    async def execute(self, *commands: Command) -> list[Any]:
        """Each command's reply; an error reply raises once all replies are read."""
        if self._cluster:
            return await self._through_client(commands)
        reused = bool(self._idle)
        try:
            return await self._round_trip(commands)
        except RedisConnectionError:
            if not reused:
                raise
            # kept connections go stale together (Redis restarted, an idle timeout): drop
            # them and try once on a new one, as redis-py retries; a Redis that is down
            # fails that connect at once
            await self.close()
            return await self._round_trip(commands)

    async def _round_trip(self, commands: Sequence[Command]) -> list[Any]:
        pool = self._client.connection_pool
        connection = self._idle.pop() if self._idle else pool.make_connection()
        try:
            await connection.send_packed_command(pack(commands), check_health=False)
            replies, error = [], None
            for _ in commands:
                try:
                    replies.append(await connection.read_response())
                except ResponseError as exc:
                    error = error or exc
        except BaseException:
            # a reply may be left unread: the connection is out of step, never reuse it
            await connection.disconnect(nowait=True)
            raise
        self._idle.append(connection)
        if error is not None:
            raise error
        return replies

    async def call(self, *command: Any) -> Any:
        """One command's reply."""
        (reply,) = await self.execute(command)
        return reply

    async def _through_client(self, commands: Sequence[Command]) -> list[Any]:
        if len(commands) == 1:
            return [await self._client.execute_command(*commands[0])]
        async with self._client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute()

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.disconnect()
