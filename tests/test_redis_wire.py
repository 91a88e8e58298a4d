"""The hot path's own connections: replies in order, errors that leave them in step, cancels,
and RESP packed as redis-py packs it."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sluice.shared.redis_client import async_client, is_cluster, sync_client
from sluice.shared.redis_wire import Wire, pack, stream_entries, xadd

from tests.conftest import free_port, wait_until
from tests.redis_cluster import EmbeddedCluster


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = async_client(redis_url, socket_timeout_s=None)
    yield client
    await client.aclose()


@pytest.fixture
async def wire(client: aioredis.Redis) -> AsyncIterator[Wire]:
    wire = Wire(client)
    yield wire
    await wire.close()


@pytest.fixture
def own_connections(client: aioredis.Redis) -> None:
    """For tests of the Wire's own connections, which a cluster client does not use."""
    if is_cluster(client):
        pytest.skip("a cluster client picks its own connections")


async def test_commands_of_one_round_trip_answer_in_order(wire: Wire) -> None:
    replies = await wire.execute(
        xadd("{w}s", {"h": b"1", "d": b"2"}), ("XLEN", "{w}s"), ("INCRBY", "{w}n", 5)
    )
    assert replies[1:] == [1, 5]
    reply = await wire.call("XREAD", "COUNT", 5, "STREAMS", "{w}s", "0-0")
    ((stream, ((entry_id, fields),)),) = stream_entries(reply)
    assert (stream, entry_id) == (b"{w}s", replies[0])
    # flat on a connection of the Wire's own; a cluster client's callbacks make it a dict
    assert fields in ([b"h", b"1", b"d", b"2"], {b"h": b"1", b"d": b"2"})


async def test_an_error_reply_raises_after_the_others_ran(wire: Wire) -> None:
    await wire.call("SET", "{w}text", "abc")
    with pytest.raises(ResponseError, match="not an integer"):
        await wire.execute(("INCR", "{w}text"), ("SET", "{w}after", "1"))
    # the command after the failing one ran, and the connection is still in step
    assert await wire.call("GET", "{w}after") == b"1"
    assert await wire.call("GET", "{w}text") == b"abc"


@pytest.mark.usefixtures("own_connections")
async def test_a_connection_is_kept_for_the_next_call(wire: Wire) -> None:
    first = await wire.call("CLIENT", "ID")
    assert await wire.call("CLIENT", "ID") == first


@pytest.mark.usefixtures("own_connections")
async def test_a_read_cancelled_while_blocked_leaves_no_reply_behind(
    wire: Wire, client: aioredis.Redis
) -> None:
    blocked_id = await wire.call("CLIENT", "ID")
    read = asyncio.create_task(wire.call("XREAD", "BLOCK", 0, "STREAMS", "{w}s", "$"))
    while b"cmd=xread" not in await client.execute_command("CLIENT", "LIST", "ID", blocked_id):
        await asyncio.sleep(0.005)  # Redis's state: nothing to await until it shows the block
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    await client.xadd("{w}s", {"late": "entry"})
    # a fresh connection answers the next call, not the late entry for the cancelled read
    assert await wire.call("PING") == b"PONG"
    assert await wire.call("CLIENT", "ID") != blocked_id


@pytest.mark.usefixtures("own_connections")
async def test_a_kept_connection_that_went_stale_is_replaced(
    wire: Wire, client: aioredis.Redis
) -> None:
    stale = await wire.call("CLIENT", "ID")
    await client.execute_command("CLIENT", "KILL", "ID", stale)  # as a Redis restart would
    assert await wire.call("SET", "{w}k", "v") == b"OK"
    assert await wire.call("CLIENT", "ID") != stale


def test_stream_entries_reads_either_protocol() -> None:
    entries = [[b"1-0", [b"h", b"x"]]]
    assert list(stream_entries({b"s": entries})) == [(b"s", entries)]
    assert list(stream_entries([[b"s", entries]])) == [[b"s", entries]]
    assert list(stream_entries(None)) == []


def test_pack_writes_what_redis_py_writes() -> None:
    blob = memoryview(np.arange(8192, dtype=np.float32)).cast("B")  # 32 KB: a buffer of its own
    commands = [
        ("XADD", "{w}s", "MAXLEN", "~", 10_000, "*", "h", b"\x00\xff", "d", blob),
        ("EVAL", "return ARGV[1]", 0, "naïve", -7, bytearray(b"x"), b""),
    ]
    reference = Connection().pack_commands(commands)
    buffers = pack(commands)
    assert b"".join(bytes(b) for b in buffers) == b"".join(bytes(b) for b in reference)
    assert any(b is commands[0][-1] for b in buffers)  # the blob itself, not a copy


async def test_no_commands_is_no_round_trip(wire: Wire) -> None:
    assert await asyncio.wait_for(wire.execute(), 5) == []


@pytest.mark.usefixtures("own_connections")
async def test_a_call_on_a_new_connection_that_is_killed_fails_as_a_connection_error(
    wire: Wire, client: aioredis.Redis
) -> None:
    async def blocked_readers() -> set[str]:
        listing = (await client.execute_command("CLIENT", "LIST")).decode()
        return {
            line.split()[0].removeprefix("id=")  # CLIENT LIST lines begin with id=
            for line in listing.splitlines()
            if "cmd=xread" in line
        }

    earlier = await blocked_readers()  # a connection of another test, not yet closed
    read = asyncio.create_task(wire.call("XREAD", "BLOCK", 0, "STREAMS", "{w}s", "$"))
    ours: set[str] = set()
    while not ours:  # Redis's state: nothing to await until it shows the block
        await asyncio.sleep(0.005)
        ours = await blocked_readers() - earlier
    (client_id,) = ours
    await client.execute_command("CLIENT", "KILL", "ID", client_id)
    with pytest.raises(RedisConnectionError):
        await read
    assert await wire.call("PING") == b"PONG"


@pytest.mark.usefixtures("own_connections")
async def test_a_reply_that_does_not_come_within_the_socket_timeout_fails_the_call(
    redis_url: str,
) -> None:
    impatient = async_client(redis_url, socket_timeout_s=0.2)
    wire = Wire(impatient)
    try:
        first = await wire.call("CLIENT", "ID")
        with pytest.raises(RedisTimeoutError):
            await wire.call("XREAD", "BLOCK", 0, "STREAMS", "{w}quiet", "$")
        assert await wire.call("CLIENT", "ID") != first  # the out-of-step one is dropped
    finally:
        await wire.close()
        await impatient.aclose()


@pytest.mark.usefixtures("own_connections")
async def test_push_messages_are_no_call_s_reply(wire: Wire, client: aioredis.Redis) -> None:
    await wire.call("CLIENT", "TRACKING", "ON")
    await wire.call("SET", "{w}tracked", "1")
    assert await wire.call("GET", "{w}tracked") == b"1"
    await client.set("{w}tracked", "2")  # Redis pushes an invalidation to the wire's connection
    assert await wire.call("GET", "{w}tracked") == b"2"
    assert await wire.call("ECHO", "in step") == b"in step"


@pytest.mark.usefixtures("own_connections")
async def test_error_replies_raise_redis_py_s_exception_classes(wire: Wire) -> None:
    with pytest.raises(NoScriptError):
        await wire.call("EVALSHA", "0" * 40, 0)
    assert await wire.call("ECHO", "in step") == b"in step"


@pytest.fixture
def tls_redis_url(tmp_path: Path) -> Iterator[str]:
    """A redis-server speaking only TLS (a managed Redis's rediss://), with its own cert."""
    server, openssl = shutil.which("redis-server"), shutil.which("openssl")
    if server is None or openssl is None:
        pytest.skip("needs redis-server and openssl on PATH")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    make_cert = (openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1")
    subprocess.run(
        [*make_cert, "-subj", "/CN=localhost", "-keyout", key, "-out", cert],
        check=True,
        capture_output=True,
    )
    port = free_port()
    tls = ("--tls-port", str(port), "--tls-cert-file", cert, "--tls-key-file", key)
    trust = ("--tls-ca-cert-file", cert, "--tls-auth-clients", "no")
    quiet = ("--save", "", "--appendonly", "no", "--dir", str(tmp_path))
    process = subprocess.Popen(
        [server, "--port", "0", *tls, *trust, *quiet],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none"
    probe = sync_client(url)

    def answers() -> bool:
        if process.poll() is not None:
            return True
        try:
            return bool(probe.ping())
        except RedisConnectionError:
            return False

    try:
        wait_until(answers, "the TLS redis-server")
        if process.poll() is not None:
            pytest.skip("this redis-server was built without TLS")
        yield url
    finally:
        probe.close()
        process.terminate()
        process.wait()


async def test_a_wire_speaks_over_tls(tls_redis_url: str) -> None:
    client = async_client(tls_redis_url)
    wire = Wire(client)
    blob = bytes(range(256)) * 400  # 100 KB: written as a buffer of its own
    try:
        entry_id, length = await wire.execute(
            xadd("{w}s", {"h": b"1", "d": blob}), ("XLEN", "{w}s")
        )
        assert length == 1
        reply = await wire.call("XREAD", "COUNT", 1, "STREAMS", "{w}s", "0-0")
        ((_, ((read_id, fields),)),) = stream_entries(reply)
        assert (read_id, fields) == (entry_id, [b"h", b"1", b"d", blob])
    finally:
        await wire.close()
        await client.aclose()


def test_a_stream_read_through_a_cluster_goes_to_its_node_without_key_lookups() -> None:
    """redis-py's cluster client asks its default node for an XREAD's keys (COMMAND GETKEYS,
    twice a call); a Wire names the stream's node itself."""

    async def scenario(url: str) -> tuple[list[Any], int]:
        client = async_client(url, socket_timeout_s=None)
        wire = Wire(client)
        try:
            await client.initialize()
            stream = "sluice:{m2:wire}:requests"
            await client.xadd(stream, {"f": "v"})
            nodes = client.get_primaries()
            before = [await client.info("commandstats", target_nodes=n) for n in nodes]
            reply = await wire.call("XREAD", "COUNT", 5, "STREAMS", stream, "0-0")
            after = [await client.info("commandstats", target_nodes=n) for n in nodes]
            lookups = sum(
                a.get("cmdstat_command", {}).get("calls", 0)
                - b.get("cmdstat_command", {}).get("calls", 0)
                for a, b in zip(after, before, strict=True)
            )
            return list(stream_entries(reply)), lookups
        finally:
            await wire.close()
            await client.aclose()

    with EmbeddedCluster() as cluster:
        entries, lookups = asyncio.run(scenario(cluster.url))
    ((_, read),) = entries
    assert len(read) == 1
    assert lookups == 0
