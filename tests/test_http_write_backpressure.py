"""A client that does not read what it asked for holds the HTTP layer back: a streamed answer is
pulled, and pipelined requests are handled, only as fast as the client reads, so the gateway
never buffers their answers without bound; once the client reads, it gets every answer."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from sluice.shared.http_messages import HttpRequest, HttpResponse
from sluice.shared.http_server import HttpServer

CHUNK = 64 << 10
COUNT = 200  # 12.5 MiB of answers, far more than the socket buffers hold
BODY, STREAMED = b"\x01" * CHUNK, b"\x02" * CHUNK


class Counting:
    """A handler whose answers are large: a stream of COUNT chunks, or one CHUNK body."""

    def __init__(self) -> None:
        self.handled = 0
        self.pulled = 0

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        self.handled += 1
        if request.path == "/stream":
            return HttpResponse(200, stream=self._chunks())
        return HttpResponse(200, BODY)

    async def _chunks(self) -> AsyncIterator[bytes]:
        for _ in range(COUNT):
            self.pulled += 1
            yield STREAMED


@pytest.fixture
async def served() -> AsyncIterator[tuple[HttpServer, Counting]]:
    handler = Counting()
    server = HttpServer(handler)
    await server.start("127.0.0.1", 0)
    yield server, handler
    await server.shutdown(1.0)


@pytest.fixture
def client() -> Iterator[socket.socket]:
    """A client socket with a small receive buffer, that reads only when told."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    yield sock
    sock.close()


def _port(server: HttpServer) -> int:
    assert server._server is not None
    return int(server._server.sockets[0].getsockname()[1])


async def quiet(count: Callable[[], int]) -> int:
    """Run the loop until `count()` stops growing for 200 turns in a row; its value then."""
    last, still = count(), 0
    while still < 200:
        await asyncio.sleep(0)
        now = count()
        last, still = now, (still + 1 if now == last else 0)
    return last


async def read_all(sock: socket.socket, body_bytes: int, byte: bytes) -> bytes:
    """What arrives until `body_bytes` of `byte` have, or the server closes."""
    loop = asyncio.get_running_loop()
    data, seen = bytearray(), 0
    while seen < body_bytes and (chunk := await loop.sock_recv(sock, 1 << 20)):
        data += chunk
        seen += chunk.count(byte)
    return bytes(data)


async def send(served: tuple[HttpServer, Counting], client: socket.socket, data: bytes) -> None:
    server, _ = served
    loop = asyncio.get_running_loop()
    await loop.sock_connect(client, ("127.0.0.1", _port(server)))
    await loop.sock_sendall(client, data)


async def test_a_stream_is_pulled_only_as_fast_as_the_client_reads(
    served: tuple[HttpServer, Counting], client: socket.socket
) -> None:
    handler = served[1]
    await send(served, client, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await quiet(lambda: handler.pulled) < COUNT // 2
    received = await read_all(client, COUNT * CHUNK, STREAMED[:1])
    assert received.count(STREAMED[:1]) == COUNT * CHUNK
    assert handler.pulled == COUNT


async def test_pipelined_requests_wait_for_the_client_to_read_the_answers(
    served: tuple[HttpServer, Counting], client: socket.socket
) -> None:
    handler = served[1]
    await send(served, client, b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n" * COUNT)
    assert await quiet(lambda: handler.handled) < COUNT // 2
    received = await read_all(client, COUNT * CHUNK, BODY[:1])
    assert received.count(b"HTTP/1.1 200") == COUNT
    assert received.count(BODY[:1]) == COUNT * CHUNK
    assert handler.handled == COUNT
