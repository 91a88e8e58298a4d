"""Streamed answers (server-sent events: generate_stream, a job's events) on the HTTP layer on its
own: each chunk is sent as it is produced, chunked to an HTTP/1.1 client, whose connection then
serves its next request; an HTTP/1.0 client, which knows no chunks, gets the body until the
close."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from sluice.shared.http_messages import HttpRequest, HttpResponse
from sluice.shared.http_server import HttpServer

EVENTS = b"text/event-stream"


class Producer:
    """A handler whose /stream answer yields what the test puts, one chunk at a time; None
    ends it, an exception fails it."""

    def __init__(self) -> None:
        self.chunks: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()
        self.closed = asyncio.Event()

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path == "/stream":
            return HttpResponse(200, headers=[(b"content-type", EVENTS)], stream=self._stream())
        return HttpResponse(200, request.path.encode())

    async def _stream(self) -> AsyncIterator[bytes]:
        try:
            while (chunk := await self.chunks.get()) is not None:
                if isinstance(chunk, Exception):
                    raise chunk
                yield chunk
        finally:
            self.closed.set()


@pytest.fixture
async def served() -> AsyncIterator[tuple[int, Producer]]:
    producer = Producer()
    server = HttpServer(producer)
    await server.start("127.0.0.1", 0)
    assert server._server is not None
    yield int(server._server.sockets[0].getsockname()[1]), producer
    await server.shutdown(1.0)


async def _connect(port: int, request: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    return reader, writer


async def _head(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes]]:
    status, *fields = (await reader.readuntil(b"\r\n\r\n")).rstrip(b"\r\n").split(b"\r\n")
    return status, dict(field.lower().split(b": ", 1) for field in fields)


async def _plain_answer(reader: asyncio.StreamReader) -> bytes:
    status, headers = await _head(reader)
    assert status == b"HTTP/1.1 200 OK"
    return await reader.readexactly(int(headers[b"content-length"]))


GET_STREAM = b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"


async def test_an_http_1_1_stream_is_chunked_each_chunk_sent_as_produced_and_kept_alive(
    served: tuple[int, Producer],
) -> None:
    port, producer = served
    reader, writer = await _connect(port, GET_STREAM)
    producer.chunks.put_nowait(b"data: 1\n\n")
    status, headers = await _head(reader)
    assert status == b"HTTP/1.1 200 OK"
    assert headers[b"transfer-encoding"] == b"chunked"
    assert headers[b"connection"] == b"keep-alive"
    assert b"content-length" not in headers
    # each chunk arrives before the next is produced: the stream waits on this test
    assert await reader.readuntil(b"data: 1\n\n\r\n") == b"9\r\ndata: 1\n\n\r\n"
    producer.chunks.put_nowait(b"")  # nothing to send, and no end of the body either
    producer.chunks.put_nowait(b"data: 22\n\n")
    assert await reader.readuntil(b"\n\n\r\n") == b"a\r\ndata: 22\n\n\r\n"
    producer.chunks.put_nowait(None)
    assert await reader.readexactly(5) == b"0\r\n\r\n"
    writer.write(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection serves on
    assert await _plain_answer(reader) == b"/next"
    writer.close()


async def test_a_request_pipelined_behind_a_stream_is_answered_after_it(
    served: tuple[int, Producer],
) -> None:
    port, producer = served
    reader, writer = await _connect(port, GET_STREAM + b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
    producer.chunks.put_nowait(b"x")
    producer.chunks.put_nowait(None)
    await _head(reader)
    assert await reader.readexactly(11) == b"1\r\nx\r\n0\r\n\r\n"
    assert await _plain_answer(reader) == b"/after"
    writer.close()


async def test_an_http_1_0_client_gets_the_body_until_the_close(
    served: tuple[int, Producer],
) -> None:
    port, producer = served
    reader, writer = await _connect(port, b"GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    producer.chunks.put_nowait(b"data: 1\n\n")
    status, headers = await _head(reader)
    assert status == b"HTTP/1.0 200 OK"
    assert headers[b"connection"] == b"close"
    assert b"transfer-encoding" not in headers
    assert await reader.readexactly(9) == b"data: 1\n\n"
    producer.chunks.put_nowait(None)
    assert await reader.read() == b""  # closed: the end of the body
    writer.close()


async def test_a_client_that_asks_for_a_close_gets_it_after_the_last_chunk(
    served: tuple[int, Producer],
) -> None:
    port, producer = served
    reader, writer = await _connect(port, b"GET /stream HTTP/1.1\r\nConnection: close\r\n\r\n")
    producer.chunks.put_nowait(b"x")
    producer.chunks.put_nowait(None)
    _, headers = await _head(reader)
    assert (headers[b"transfer-encoding"], headers[b"connection"]) == (b"chunked", b"close")
    assert await reader.read() == b"1\r\nx\r\n0\r\n\r\n"
    writer.close()


async def test_head_of_a_stream_sends_its_headers_and_keeps_alive(
    served: tuple[int, Producer],
) -> None:
    port, _ = served
    reader, writer = await _connect(port, b"HEAD /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    _, headers = await _head(reader)
    assert headers[b"transfer-encoding"] == b"chunked"
    writer.write(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await _plain_answer(reader) == b"/next"  # no body came before it
    writer.close()


async def test_a_stream_that_fails_ends_the_connection_without_the_last_chunk(
    served: tuple[int, Producer],
) -> None:
    port, producer = served
    reader, writer = await _connect(port, GET_STREAM)
    producer.chunks.put_nowait(b"x")
    producer.chunks.put_nowait(RuntimeError("the stream broke"))
    await _head(reader)
    assert await reader.read() == b"1\r\nx\r\n"  # a client sees the body cut short
    await producer.closed.wait()
    writer.close()


async def test_a_client_that_goes_away_lets_the_stream_go(served: tuple[int, Producer]) -> None:
    port, producer = served
    reader, writer = await _connect(port, GET_STREAM)
    producer.chunks.put_nowait(b"x")
    await _head(reader)
    writer.close()
    await producer.closed.wait()
