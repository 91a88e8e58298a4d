"""A small HTTP/1.1 server on asyncio + httptools, made for the gateway's hot path.

Measured against uvicorn's ASGI layer, most of a request's gateway time went to ASGI message
plumbing and to writing the status line and the body in two syscalls. Here a request is
parsed by httptools into one `HttpRequest`, handled by one coroutine, and answered with one
write. Keep-alive, pipelining (answered in order), `Expect: 100-continue`, a body size
limit and graceful shutdown are handled; nothing else is needed by KServe v2 clients.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import unquote

import httptools
import orjson

log = logging.getLogger(__name__)

#: pipelined requests a connection may queue before we stop reading from it.
MAX_PIPELINED = 32
#: a request must arrive whole within this time of its first byte (slow senders are cut off).
REQUEST_TIMEOUT_S = 30.0
#: an idle keep-alive connection is closed after this long.
IDLE_TIMEOUT_S = 300.0


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    headers: dict[bytes, bytes]
    body: bytes
    #: resolves when the client closes its connection (the request may be dropped then).
    disconnected: asyncio.Future[None]
    #: set when the body was over the size limit (and dropped): why it is refused (413).
    refusal: str | None = None
    #: the raw query string (after `?`).
    query: str = ""


@dataclass(slots=True)
class HttpResponse:
    status: int
    body: bytes | list[bytes | memoryview] = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    #: a body written piece by piece as it is produced (server-sent events); the
    #: connection closes after it.
    stream: AsyncIterator[bytes] | None = None


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def encode_response(response: HttpResponse, accept_encoding: bytes, keep_alive: bool) -> bytes:
    """Status line, headers and body as one buffer (one write, one syscall)."""
    body = response.body
    if isinstance(body, list):
        body = b"".join(body)
    headers = response.headers
    if body and accept_encoding and (b"gzip" in accept_encoding or b"deflate" in accept_encoding):
        gzip = b"gzip" in accept_encoding
        compressor = zlib.compressobj(wbits=16 + zlib.MAX_WBITS) if gzip else zlib.compressobj()
        body = compressor.compress(body) + compressor.flush()
        headers = [*headers, (b"content-encoding", b"gzip" if gzip else b"deflate")]
    status = response.status
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
    lines += [b"%s: %s\r\n" % pair for pair in headers]
    lines.append(b"content-length: %d\r\n" % len(body))
    if not keep_alive:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    lines.append(body)
    return b"".join(lines)


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: collections.deque[tuple[HttpRequest, bool]] = collections.deque()
        self.disconnected: asyncio.Future[None] = self.loop.create_future()
        self.worker: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        #: when the connection's timer expires (loop time), and why (None: idle).
        self.deadline = 0.0
        self.deadline_message: str | None = None
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.refusal: str | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.server.connections.add(self)
        self._arm(IDLE_TIMEOUT_S, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        if not self.disconnected.done():
            self.disconnected.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(f"malformed HTTP request: {exc}")

    # -- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reset()
        self._arm(REQUEST_TIMEOUT_S, "request not received in full within the time allowed")

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        if self.headers.get(b"expect", b"").lower() == b"100-continue" and self.transport:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.server.max_body_bytes:
            self.refusal = f"request body exceeds the limit of {self.server.max_body_bytes} bytes"
            self.body = []
        elif self.refusal is None:
            self.body.append(body)

    def _arm(self, delay_s: float, message: str | None) -> None:
        """Set the connection's deadline: an incomplete request or an idle connection.

        This runs three times per request, where a new timer each time cost ~10 us: instead
        one timer checks the latest deadline, waking at least once per shortest timeout so
        that no deadline set meanwhile is checked late.
        """
        self.deadline = self.loop.time() + delay_s
        self.deadline_message = message
        if self.timer is None:
            self._start_timer()

    def _start_timer(self) -> None:
        check_at = self.loop.time() + min(REQUEST_TIMEOUT_S, IDLE_TIMEOUT_S)
        self.timer = self.loop.call_at(min(self.deadline, check_at), self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        if self.loop.time() < self.deadline:
            self._start_timer()
            return
        message = self.deadline_message
        if message is None:  # idle keep-alive connection
            self.close_if_idle()
        elif self.worker is None:
            self._fail(message, status=408)

    def on_message_complete(self) -> None:
        self._arm(IDLE_TIMEOUT_S, None)
        path, _, query = self.url.partition(b"?")
        request = HttpRequest(
            self.parser.get_method().decode("latin-1"),
            unquote(path.decode("latin-1")) if path else "/",
            self.headers,
            self.body[0] if len(self.body) == 1 else b"".join(self.body),
            self.disconnected,
            self.refusal,
            query.decode("latin-1"),
        )
        self.queue.append((request, self.parser.should_keep_alive()))
        if len(self.queue) >= MAX_PIPELINED and self.transport:
            self.transport.pause_reading()
        if self.worker is None:
            self.worker = self.loop.create_task(self._answer())

    # -- answering -----------------------------------------------------------------------

    async def _answer(self) -> None:
        """Handle queued requests one by one, so pipelined answers keep their order."""
        try:
            while self.queue:
                request, keep_alive = self.queue[0]
                self.server.busy += 1
                try:
                    response = await self.server.handler(request)
                finally:
                    self.server.busy -= 1
                self.queue.popleft()
                if self.transport is None or self.transport.is_closing():
                    return
                if response.stream is not None:
                    await self._stream(response)
                    return
                keep_alive = keep_alive and not self.server.closing
                accept = request.headers.get(b"accept-encoding", b"")
                self.transport.write(encode_response(response, accept, keep_alive))
                if not keep_alive:
                    self.transport.close()
                    return
                if len(self.queue) < MAX_PIPELINED:
                    self.transport.resume_reading()
        finally:
            self.worker = None
            self.server.idle.set()
            if self.transport is not None and not self.transport.is_closing():
                self._arm(IDLE_TIMEOUT_S, None)

    async def _stream(self, response: HttpResponse) -> None:
        assert self.transport is not None and response.stream is not None
        head = [b"HTTP/1.1 %d %s\r\n" % (response.status, _REASONS.get(response.status, b""))]
        head += [b"%s: %s\r\n" % pair for pair in response.headers]
        self.transport.write(b"".join([*head, b"connection: close\r\n\r\n"]))
        try:
            async for chunk in response.stream:
                if self.transport.is_closing():
                    break
                self.transport.write(chunk)
        finally:
            self.transport.close()

    def _fail(self, message: str, status: int = 400) -> None:
        if self.transport is not None and not self.transport.is_closing():
            body = orjson.dumps({"error": message})
            response = HttpResponse(status, body, [(b"content-type", b"application/json")])
            self.transport.write(encode_response(response, b"", keep_alive=False))
            self.transport.close()

    def close_if_idle(self) -> None:
        if self.worker is None and self.transport is not None:
            self.transport.close()


class HttpServer:
    """Serves `handler` on host:port until `shutdown()`."""

    def __init__(self, handler: Handler, max_body_bytes: int = 64 << 20) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.connections: set[_Connection] = set()
        self.busy = 0
        self.closing = False
        self.idle = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def _drained(self, timeout_s: float) -> bool:
        """Whether every connection finished its requests within `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                while any(c.worker is not None for c in self.connections):
                    self.idle.clear()
                    await self.idle.wait()
        except TimeoutError:
            return False
        return True

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, backlog=4096, reuse_address=True
        )

    async def shutdown(
        self,
        timeout_s: float,
        on_timeout: Callable[[], None] | None = None,
        answer_s: float = 1.0,
    ) -> None:
        """Stop accepting, answer what is in flight (up to `timeout_s`), close the rest.

        Requests still in flight at `timeout_s` are handed to `on_timeout`, which should end
        them (with an error), and get `answer_s` more for their answers to be written.
        """
        self.closing = True
        if self._server is not None:
            self._server.close()
        await asyncio.sleep(0)  # requests already in the sockets are read, and so drained
        if not await self._drained(timeout_s):
            log.warning("shutdown: %d requests still in flight after %gs", self.busy, timeout_s)
            if on_timeout is not None:
                on_timeout()
                await self._drained(answer_s)
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.close()
