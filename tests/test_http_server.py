"""The gateway's HTTP layer on its own: pipelining, 100-continue, slow senders, body limit."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
from sluice.shared import http_server
from sluice.shared.http_messages import HttpRequest, HttpResponse
from sluice.shared.http_server import HttpServer


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


async def test_requests_before_a_malformed_one_are_answered_first(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\n\r\nNOT HTTP\r\n\r\n")
    assert await _read_response(reader) == (200, b"GET /a 0")
    assert await _read_response(reader) == (200, b"GET /b 0")
    status, body = await _read_response(reader)
    assert status == 400 and b"malformed HTTP request" in body
    assert await reader.read() == b""
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


async def _slow_then_echo(request: HttpRequest) -> HttpResponse:
    if request.path == "/slow":  # a handler that outlasts the request timeout
        await asyncio.sleep(http_server.REQUEST_TIMEOUT_S * 3)
    return await _echo(request)


@pytest.mark.parametrize("handler", [_echo, _slow_then_echo], ids=["quick", "slow"])
async def test_a_slow_sender_pipelined_behind_a_request_is_cut_off(
    monkeypatch: pytest.MonkeyPatch, handler: http_server.Handler
) -> None:
    # the partial request arrives while the one before it is handled: its own deadline
    # holds, not the idle one that follows the answer before it
    monkeypatch.setattr(http_server, "REQUEST_TIMEOUT_S", 0.2)
    monkeypatch.setattr(http_server, "IDLE_TIMEOUT_S", 600.0)
    srv = HttpServer(handler, max_body_bytes=1000)
    await srv.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(srv))
    writer.write(
        b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab"
    )
    assert await _read_response(reader) == (200, b"GET /slow 0")
    status, body = await asyncio.wait_for(_read_response(reader), 10)
    assert status == 408 and b"not received in full" in body
    assert await reader.read() == b""
    writer.close()
    await srv.shutdown(1.0)


async def test_a_closed_connection_is_freed_by_reference_counting(server: HttpServer) -> None:
    # a long-running process collects cycles rarely (shared/gc_tuning.py): a connection and
    # what it read must not wait for the collector once the client has gone
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    assert await _read_response(reader) == (200, b"POST /x 3")
    (connection,) = server.connections
    freed, gone = weakref.ref(connection), connection.disconnected
    del connection
    gc.disable()
    try:
        writer.close()
        await gone
        assert freed() is None
    finally:
        gc.enable()


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


async def _read_head(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes]]:
    """The status line and the headers (names lowercased) of the next response."""
    status_line, *lines = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")[:-2]
    headers = dict(line.split(b": ", 1) for line in lines)
    return status_line, {name.lower(): value for name, value in headers.items()}


async def test_head_sends_the_headers_of_a_get_and_no_body(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"HEAD /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
    status_line, headers = await _read_head(reader)
    assert status_line == b"HTTP/1.1 200 OK"
    assert headers[b"content-length"] == str(len(b"GET /a 0")).encode()  # as a GET's would be
    # what follows is the next answer, not a body
    assert await _read_response(reader) == (200, b"GET /b 0")
    writer.close()


async def test_an_http_1_0_client_gets_its_version_and_a_close(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"GET /a HTTP/1.0\r\n\r\n")
    status_line, headers = await _read_head(reader)
    assert status_line == b"HTTP/1.0 200 OK"
    assert headers[b"connection"] == b"close"
    assert await reader.read() == b"GET /a 0"  # then the connection is closed
    writer.close()


async def test_an_http_1_0_client_asking_for_keep_alive_gets_it_said(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    for path in (b"/a", b"/b"):
        writer.write(b"GET %s HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" % path)
        status_line, headers = await _read_head(reader)
        assert status_line == b"HTTP/1.0 200 OK"
        assert headers[b"connection"] == b"keep-alive"
        assert await reader.readexactly(int(headers[b"content-length"])) == b"GET %s 0" % path
    writer.close()


@pytest.mark.parametrize(
    "head",
    [
        b"".join(b"X-H%d: v\r\n" % i for i in range(101)),  # more than 100 header fields
        b"X-Same: v\r\n" * 101,  # as many, all of one name
        b"X-Big: " + b"v" * (16 << 10) + b"\r\n",  # more than 16 KiB of header fields
    ],
    ids=["101 fields", "101 of one name", "16 KiB"],
)
async def test_too_many_or_too_large_headers_are_a_431_and_a_close(
    server: HttpServer, head: bytes
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"GET /a HTTP/1.1\r\n" + head + b"\r\n")
    status, body = await _read_response(reader)
    assert status == 431 and b"header fields" in body
    assert await reader.read() == b""
    writer.close()


async def test_headers_at_the_limits_are_served(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    fields = b"".join(b"X-H%d: v\r\n" % i for i in range(99))
    writer.write(b"GET /a HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
    assert await _read_response(reader) == (200, b"GET /a 0")
    writer.close()


async def test_a_header_that_never_ends_is_cut_off_early(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"GET /a HTTP/1.1\r\nX-Endless: ")
    for _ in range(64):  # 4 MiB of one header value, and no end of it
        writer.write(b"v" * (64 << 10))
        await writer.drain()
    status, _ = await _read_response(reader)
    assert status == 431
    writer.close()


async def test_no_100_continue_for_a_body_over_the_limit(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(
        b"POST /x HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2000\r\n\r\n"
    )
    status, body = await _read_response(reader)  # the refusal, at once, and no 100
    assert status == 413 and b"exceeds the limit of 1000 bytes" in body
    assert await reader.read() == b""
    writer.close()


async def test_no_100_continue_for_a_request_the_precheck_refuses() -> None:
    def precheck(method: str, path: str, headers: dict[bytes, bytes]) -> HttpResponse | None:
        return HttpResponse(401, b"no") if path == "/private" else None

    srv = HttpServer(_echo, max_body_bytes=1000, precheck=precheck)
    await srv.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(srv))
    writer.write(b"POST /private HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert await _read_response(reader) == (401, b"no")
    assert await reader.read() == b""
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(srv))
    writer.write(b"POST /public HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"ok")
    assert await _read_response(reader) == (200, b"POST /public 2")
    writer.close()
    await srv.shutdown(1.0)


async def test_no_100_continue_for_an_http_1_0_client(server: HttpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(server))
    writer.write(b"POST /x HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok")
    status_line, _ = await _read_head(reader)
    assert status_line == b"HTTP/1.0 200 OK"
    writer.close()
