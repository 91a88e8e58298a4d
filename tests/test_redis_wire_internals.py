"""The private parts of redis-py that shared/redis_wire.py drives are still there, as it uses them.

redis-py makes no promise about `redis._parsers` or a connection's `_writer`; pyproject pins
redis to the releases these checks pass on. A failure here names the part that moved, so a
new redis-py release is judged by what it changed, not by a hung or garbled reply stream.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import hiredis
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import BusyLoadingError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from sluice.shared.redis_client import async_client, is_cluster

MOVED = f"redis-py {redis.__version__}: shared/redis_wire.py relies on "


def test_the_parser_turns_error_replies_into_redis_py_exceptions() -> None:
    try:
        from redis._parsers.base import BaseParser
    except ImportError as exc:
        pytest.fail(MOVED + f"redis._parsers.base.BaseParser, which is gone ({exc})")
    parse_error = getattr(BaseParser, "parse_error", None)
    assert callable(parse_error), MOVED + "BaseParser.parse_error, which is gone"
    assert isinstance(inspect.getattr_static(BaseParser, "parse_error"), classmethod), (
        MOVED + "BaseParser.parse_error being a classmethod (hiredis calls it unbound)"
    )
    assert list(inspect.signature(parse_error).parameters) == ["response"], (
        MOVED + f"BaseParser.parse_error(response), now {inspect.signature(parse_error)}"
    )
    replies = {
        "READONLY You can't write against a read only replica.": ReadOnlyError,
        "LOADING Redis is loading the dataset in memory": BusyLoadingError,
        "ERR value is not an integer": ResponseError,
    }
    for reply, expected in replies.items():
        error = parse_error(reply)
        assert isinstance(error, expected), (
            MOVED + f"BaseParser.parse_error({reply!r}) giving {expected.__name__}, "
            f"now {type(error).__name__}"
        )
    # the Wire takes a LOADING reply for a connection error, as redis-py does
    assert issubclass(BusyLoadingError, RedisConnectionError), MOVED + "LOADING: ConnectionError"


def test_hiredis_reader_takes_the_wire_s_options() -> None:
    marker = object()
    reader = hiredis.Reader(replyError=ResponseError, notEnoughData=marker)
    assert reader.gets() is marker, "hiredis.Reader(notEnoughData=...) changed"
    reader.feed(b">2\r\n$7\r\nmessage\r\n$1\r\nx\r\n")
    assert isinstance(reader.gets(), hiredis.PushNotification), (
        "hiredis: RESP3 pushes no longer come as hiredis.PushNotification"
    )


def test_a_pool_connection_opens_and_closes_as_the_wire_expects() -> None:
    from redis.asyncio.connection import AbstractConnection, ConnectionPool

    assert callable(getattr(ConnectionPool, "make_connection", None)), (
        MOVED + "ConnectionPool.make_connection(), which is gone"
    )
    assert "nowait" in inspect.signature(AbstractConnection.disconnect).parameters, (
        MOVED + "AbstractConnection.disconnect(nowait=True), which lost `nowait`"
    )


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = async_client(redis_url, socket_timeout_s=None)
    if is_cluster(client):
        await client.aclose()
        pytest.skip("a cluster client has no pool of its own: the Wire goes through it")
    yield client
    await client.aclose()


async def test_an_open_connection_hands_over_its_transport(client: aioredis.Redis) -> None:
    pool = client.connection_pool
    assert isinstance(pool.connection_kwargs, dict), MOVED + "ConnectionPool.connection_kwargs"
    assert "socket_timeout" in pool.connection_kwargs, (
        MOVED + "connection_kwargs['socket_timeout'] (the Wire's reply timeout)"
    )
    connection = pool.make_connection()
    await connection.connect()
    try:
        writer = getattr(connection, "_writer", None)
        assert isinstance(writer, asyncio.StreamWriter), (
            MOVED + f"an open connection's _writer being a StreamWriter, now {type(writer)}"
        )
        transport = writer.transport
        assert isinstance(transport, asyncio.Transport), MOVED + "_writer.transport"
        assert callable(getattr(transport, "set_protocol", None)), "transport.set_protocol"
    finally:
        await connection.disconnect(nowait=True)
