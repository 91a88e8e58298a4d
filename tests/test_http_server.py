"""The gateway's HTTP layer on its own: pipelining, 100-continue, slow senders, body limit."""

from __future__ import annotations

import asyncio

import pytest

from gateway import http_server
from gateway.http_server import HttpRequest, HttpResponse, HttpServer


async def _echo(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, f"{request.method} {request.path} {len(request.body)}".encode())


@pytest.fixture
async def server() -> HttpServer:
    srv = HttpServer(_echo, max_body_bytes=1000)
    await srv.start("127.0.0.1", 0)
    yield srv
    await srv.shutdown(1.0)


def _port(srv: HttpServer) -> int:
    assert srv._server is not None
    return int(srv._server.sockets[0].getsockname()[1])


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split()[1])
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
    )
    return status, await reader.readexactly(length)


async def test_pipelined_requests_are_answered_in_order(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(
        b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nPOST /b HTTP/1.1\r\nHost: x\r\n"
        b"Content-Length: 3\r\n\r\nabcGET /c%20d HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    assert await _read_response(reader) == (200, b"GET /a 0")
    assert await _read_response(reader) == (200, b"POST /b 3")
    assert await _read_response(reader) == (200, b"GET /c d 0")
    writer.close()


async def test_expect_100_continue(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(
        b"POST /x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
    )
    assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"ok")
    assert await _read_response(reader) == (200, b"POST /x 2")
    writer.close()


async def test_oversized_body_is_refused_and_malformed_http_is_400(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n" + b"a" * 2000)
    status, body = await _read_response(reader)
    assert (status, body) == (200, b"POST /x 0")  # the handler sees the refusal, not the body
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    status, body = await _read_response(reader)
    assert status == 400 and b"malformed HTTP request" in body
    writer.close()


async def test_a_slow_sender_is_cut_off(
    server: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_server, "REQUEST_TIMEOUT_S", 0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")
    status, body = await _read_response(reader)
    assert status == 408 and b"not received in full" in body
    assert await reader.read() == b""  # and the connection is closed
    writer.close()


async def test_an_idle_keep_alive_connection_is_closed_after_its_last_answer(
    server: HttpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_server, "IDLE_TIMEOUT_S", 0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    for _ in range(2):  # each request moves the idle deadline on; the connection stays open
        writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _ = await _read_response(reader)
        assert status == 200
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed once idle
    writer.close()
