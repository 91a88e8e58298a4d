"""A small HTTP/1.1 server on asyncio + httptools, made for the gateway's hot path; worker
health probes are served by it too.

Measured against uvicorn's ASGI layer, most of a request's gateway time went to ASGI message
plumbing and to writing the status line and the body in two syscalls. Here a request is
parsed by httptools into one `HttpRequest`, handled by one coroutine, and answered with one
write. Keep-alive (HTTP/1.0's too), pipelining (answered in order), streamed answers (chunked),
HEAD, `Expect: 100-continue` (sent only to a request that will be served), limits on the body
and on the header fields, and graceful shutdown are handled; nothing else is needed by KServe
v2 clients.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import select
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import unquote

import httptools
from sluice.shared.errors import (
    HeaderFieldsTooLarge,
    InvalidInput,
    PayloadTooLarge,
    RequestTimeout,
)
from sluice.shared.http_messages import (
    REASONS,
    HttpRequest,
    HttpResponse,
    encode_response,
    error_response,
)

log = logging.getLogger(__name__)

#: pipelined requests a connection may queue before we stop reading from it.
MAX_PIPELINED = 32
#: a request must arrive whole within this time of its first byte (slow senders are cut off).
REQUEST_TIMEOUT_S = 30.0
#: an idle keep-alive connection is closed after this long.
IDLE_TIMEOUT_S = 300.0
#: at most this many loop turns at shutdown to accept and read requests that arrived before.
MAX_ARRIVAL_TURNS = 100
#: more header fields than this, or more bytes of them with the URL, is a 431.
MAX_HEADERS = 100
MAX_HEADER_BYTES = 16 << 10
#: the most one read brings (asyncio's and uvloop's): httptools holds a header field until
#: it ends, so one still unfinished past MAX_HEADER_BYTES plus this is refused unfinished.
READ_SIZE = 256 << 10
#: a refused request's connection reads and drops what the client still sends for this long
#: before it closes: closing with unread data resets the connection, answer unread.
LINGER_S = 2.0


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]
#: (method, path, headers) -> the answer a request gets whatever its body (401, 404), or None:
#: lets a client that sent `Expect: 100-continue` be refused before it sends the body.
Precheck = Callable[[str, str, dict[bytes, bytes]], HttpResponse | None]


class _Refused(Exception):
    """Raised in a parser callback: answer `response` now and read no further request."""

    def __init__(self, response: HttpResponse) -> None:
        super().__init__(response.status)
        self.response = response


def _headers_too_large() -> _Refused:
    message = f"request header fields too large (at most {MAX_HEADERS} fields, {MAX_HEADER_BYTES}"
    return _Refused(error_response(HeaderFieldsTooLarge(message + " bytes)")))


def _malformed(exc: Exception) -> HttpResponse:
    return error_response(InvalidInput(f"malformed HTTP request: {exc}"))


def _split_url(url: bytes) -> tuple[str, str]:
    path, _, query = url.partition(b"?")
    return (unquote(path.decode("latin-1")) if path else "/"), query.decode("latin-1")


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        #: requests to answer, each with: keep-alive, HTTP version, whether it is a HEAD.
        self.queue: collections.deque[tuple[HttpRequest, bool, bytes, bool]] = collections.deque()
        self.disconnected: asyncio.Future[None] = self.loop.create_future()
        self.worker: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        #: when the connection's timer expires (loop time), and why (None: idle).
        self.deadline_s = 0.0
        self.deadline_message: str | None = None
        #: a request was refused before it was whole: what the client still sends is dropped.
        self.refused = False
        #: that refusal, while the requests before it are answered (pipelined, in order).
        self.refusal_answer: HttpResponse | None = None
        #: the client's HTTP version, b"1.0" or b"1.1", from its first request (one client).
        self.version: bytes | None = None
        #: the size of the chunk being parsed.
        self.chunk = 0
        #: set while the transport's buffer is over its high-water mark (a client not reading):
        #: a streamed response waits for it to drain.
        self.writable: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        #: header fields received, repeated names included.
        self.header_count = 0
        self.body: list[bytes] = []
        self.size = 0
        self.refusal: str | None = None
        #: whether the head is still arriving, and the bytes read while it did (chunk-wise,
        #: so at least its size): only a head that may be large is measured exactly.
        self.in_head = False
        self.head_read = 0

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.server.connections.add(self)
        self._arm(IDLE_TIMEOUT_S, None)

    def pause_writing(self) -> None:
        self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.resume_writing()
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.disconnected.done():
            self.disconnected.set_result(None)
        # the parser holds this connection's callbacks: a cycle, which the frozen, rarely run
        # collector (shared/gc_tuning.py) would leave in place with the body it read
        del self.parser
        self._reset()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        self.chunk = len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _Refused):
                self._refuse(exc.__context__.response)
            else:
                log.error("HTTP parser callback failed", exc_info=exc.__context__)
                self._refuse(_malformed(exc))
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._refuse(_malformed(exc))
        else:
            if self.in_head:
                self.head_read += len(data)
                if self.head_read > MAX_HEADER_BYTES + READ_SIZE:
                    self._refuse(_headers_too_large().response)

    # -- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reset()
        self.in_head = True
        self._arm(REQUEST_TIMEOUT_S, "request not received in full within the time allowed")

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value
        self.header_count += 1

    def on_headers_complete(self) -> None:
        self.in_head = False
        if self.head_read + self.chunk > MAX_HEADER_BYTES or self.header_count > MAX_HEADERS:
            self._check_head()
        if self.headers.get(b"expect", b"").lower() == b"100-continue":
            self._expect_continue()

    def _check_head(self) -> None:
        size = len(self.url) + sum(len(name) + len(value) for name, value in self.headers.items())
        if size > MAX_HEADER_BYTES or self.header_count > MAX_HEADERS:
            raise _headers_too_large()

    def _expect_continue(self) -> None:
        """Send `100 Continue` only for a request that will be served; refuse one that will
        not before the client sends its body."""
        if self.transport is None or self.parser.get_http_version() == "1.0":
            return  # an HTTP/1.0 client does not know 100 (RFC 9110 §10.1.1)
        refusal = self._refusal_before_body()
        if refusal is None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        elif not self.queue and self.worker is None:
            raise _Refused(refusal)
        # else earlier answers go first: without a 100 the client sends its body when its
        # wait runs out, and the request is refused in its turn

    def _refusal_before_body(self) -> HttpResponse | None:
        length = self.headers.get(b"content-length", b"")
        limit = self.server.max_body_bytes
        if length.isdigit() and int(length) > limit:
            return error_response(
                PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            )
        if self.server.precheck is None:
            return None
        method = self.parser.get_method()
        path, _ = _split_url(self.url)
        return self.server.precheck(
            "GET" if method == b"HEAD" else method.decode("latin-1"), path, self.headers
        )

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.server.max_body_bytes:
            self.refusal = f"request body exceeds the limit of {self.server.max_body_bytes} bytes"
            self.body = []
        elif self.refusal is None:
            self.body.append(body)

    def _arm(self, delay_s: float, message: str | None) -> None:
        """Set the connection's deadline: an incomplete request or an idle connection.

        This runs three times per request, where a new timer each time showed in the profile
        (benchmarks/RESULTS.md, 2026-11-30): instead one timer checks the latest deadline,
        waking at least once per shortest timeout so that no deadline set meanwhile is checked
        late.
        """
        self.deadline_s = self.loop.time() + delay_s
        self.deadline_message = message
        if self.timer is None:
            self._start_timer()

    def _start_timer(self) -> None:
        check_at_s = self.loop.time() + min(REQUEST_TIMEOUT_S, IDLE_TIMEOUT_S)
        self.timer = self.loop.call_at(min(self.deadline_s, check_at_s), self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        if self.loop.time() < self.deadline_s:
            self._start_timer()
            return
        message = self.deadline_message
        if message is None:  # idle keep-alive connection
            self.close_if_idle()
        elif self.worker is None:
            self._refuse(error_response(RequestTimeout(message)))
        # else the answers before the late request go first: `_answer` refuses it after them

    def on_message_complete(self) -> None:
        self._arm(IDLE_TIMEOUT_S, None)
        path, query = _split_url(self.url)
        method = self.parser.get_method()
        head = method == b"HEAD"  # handled as a GET, answered without the body
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body = []  # the request holds it, and frees it once answered
        request = HttpRequest(
            "GET" if head else method.decode("latin-1"),
            path,
            self.headers,
            body,
            self.disconnected,
            self.refusal,
            query,
        )
        if self.version is None:
            self.version = b"1.0" if self.parser.get_http_version() == "1.0" else b"1.1"
        self.queue.append((request, self.parser.should_keep_alive(), self.version, head))
        if len(self.queue) >= MAX_PIPELINED and self.transport:
            self.transport.pause_reading()
        if self.worker is None:
            self.worker = self.loop.create_task(self._answer())

    # -- answering -----------------------------------------------------------------------

    async def _answer(self) -> None:
        """Handle queued requests one by one, so pipelined answers keep their order."""
        try:
            while self.queue:
                request, keep_alive, version, head = self.queue[0]
                self.server.busy += 1
                try:
                    response = await self.server.handler(request)
                finally:
                    self.server.busy -= 1
                self.queue.popleft()
                if self.transport is None or self.transport.is_closing():
                    return
                keep_alive = keep_alive and not self.server.closing
                if response.stream is not None:
                    keep_alive = await self._stream(response, keep_alive, version, head)
                else:
                    accept = request.headers.get(b"accept-encoding", b"")
                    answer = encode_response(response, accept, keep_alive, version, head)
                    self.transport.write(answer)
                if not keep_alive:
                    self.transport.close()
                    return
                if self.writable is not None:  # the next answer waits until the client reads
                    await self.writable
                if len(self.queue) < MAX_PIPELINED:
                    self.transport.resume_reading()
        finally:
            self.worker = None
            self.server.idle.set()
            if self.transport is not None and not self.transport.is_closing():
                self._after_answers()

    def _after_answers(self) -> None:
        """Once the last answer is written: the refusal that waited for it, else the idle
        deadline, unless a request is arriving (pipelined behind those answered), whose own
        deadline holds."""
        message = self.deadline_message
        if self.refusal_answer is not None:
            self._refuse(self.refusal_answer)
        elif self.refused or message is None:
            self._arm(LINGER_S if self.refused else IDLE_TIMEOUT_S, None)
        elif self.loop.time() >= self.deadline_s:
            self._refuse(error_response(RequestTimeout(message)))
        elif self.timer is None:
            self._start_timer()

    async def _stream(
        self, response: HttpResponse, keep_alive: bool, version: bytes, head_only: bool
    ) -> bool:
        """Write a streamed answer, each chunk as it comes: chunked to an HTTP/1.1 client,
        whose connection then serves its next request (clients such as requests' `iter_lines`
        hand on a chunk as it arrives, but wait for a full buffer of a body that only the
        close ends); an HTTP/1.0 client knows no chunks, and the close ends its body. Whether
        the connection stays open."""
        assert self.transport is not None and response.stream is not None
        chunked = version == b"1.1"
        keep_alive = keep_alive and chunked
        status = response.status
        head = [b"HTTP/%s %d %s\r\n" % (version, status, REASONS.get(status, b""))]
        head += [b"%s: %s\r\n" % pair for pair in response.headers]
        if chunked:
            head.append(b"transfer-encoding: chunked\r\n")
        head.append(
            b"connection: keep-alive\r\n\r\n" if keep_alive else b"connection: close\r\n\r\n"
        )
        self.transport.write(b"".join(head))
        if head_only:
            return keep_alive
        chunks = aiter(response.stream)
        try:
            while (chunk := await self._next_chunk(chunks)) is not None:
                if self.transport.is_closing():
                    return False
                if not chunk:
                    continue  # an empty chunk would end a chunked body
                if chunked:
                    self.transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
                else:
                    self.transport.write(chunk)
                if self.writable is not None:  # the next chunk waits until the client reads
                    await self.writable
        except Exception:
            log.exception("a streamed answer failed: its connection is closed, body cut short")
            return False
        if self.transport.is_closing():  # the client went away (the stream was let go)
            return False
        if chunked:
            self.transport.write(b"0\r\n\r\n")
        return keep_alive

    async def _next_chunk(self, chunks: AsyncIterator[bytes]) -> bytes | None:
        """The stream's next chunk; None at its end, or once the client is gone: what the
        stream waits on (a job's events, a model's responses) is then let go at once rather
        than when its next chunk comes."""
        pull = asyncio.ensure_future(anext(chunks, None))
        await asyncio.wait((pull, self.disconnected), return_when=asyncio.FIRST_COMPLETED)
        if pull.done():
            return pull.result()
        pull.cancel()
        await asyncio.wait((pull,))
        if not pull.cancelled():
            pull.exception()  # the stream failed as it was left: nobody reads it now
        return None

    def _refuse(self, response: HttpResponse) -> None:
        """Answer and close, reading and dropping for a while what the client still sends, so
        that it gets to read the answer. Requests before it (pipelined) are answered first."""
        self.refused = True
        if self.worker is not None:
            self.refusal_answer = response
            return
        self.refusal_answer = None
        if self.transport is None or self.transport.is_closing():
            return
        version = b"1.0" if self.parser.get_http_version() == "1.0" else b"1.1"
        self.transport.write(encode_response(response, b"", False, version))
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._arm(LINGER_S, None)

    def close_if_idle(self) -> None:
        if self.worker is None and self.transport is not None:
            self.transport.close()


class HttpServer:
    """Serves `handler` on host:port until `shutdown()`."""

    def __init__(
        self, handler: Handler, max_body_bytes: int = 64 << 20, precheck: Precheck | None = None
    ) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.precheck = precheck
        self.connections: set[_Connection] = set()
        self.busy = 0
        self.closing = False
        self.idle = asyncio.Event()
        self._server: asyncio.Server | None = None

    def _unread(self) -> bool:
        """Whether a connection waits in the listen backlog, or bytes wait unread on an idle
        connection: requests sent before the shutdown, which closing now would reset."""
        server = self._server
        sockets = list(server.sockets) if server is not None and server.is_serving() else []
        sockets += [
            c.transport.get_extra_info("socket")
            for c in self.connections
            if c.transport is not None and c.worker is None
        ]
        poller = select.poll()
        for sock in sockets:
            if sock is not None:
                poller.register(sock.fileno(), select.POLLIN)
        return any(events & select.POLLIN for _, events in poller.poll(0))

    async def _take_arrivals(self) -> bool:
        """Turn the loop until what arrived is accepted and read; whether anything was."""
        turns = 0
        while turns < MAX_ARRIVAL_TURNS and self._unread():
            await asyncio.sleep(0)
            turns += 1
        return turns > 0

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

    async def start(self, host: str, port: int, share_port: bool = False) -> None:
        """Listen; `share_port`: with SO_REUSEPORT, beside other processes of this host that
        listen on the port too (the kernel spreads connections over them)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self),
            host,
            port,
            backlog=4096,
            reuse_address=True,
            reuse_port=share_port or None,
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
        deadline_s = asyncio.get_running_loop().time() + timeout_s
        await self._take_arrivals()
        if self._server is not None:
            self._server.close()
        drained = await self._drained(timeout_s)
        while drained and await self._take_arrivals():
            drained = await self._drained(deadline_s - asyncio.get_running_loop().time())
        if not drained:
            log.warning("shutdown: %d requests still in flight after %gs", self.busy, timeout_s)
            if on_timeout is not None:
                on_timeout()
                await self._drained(answer_s)
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.close()
