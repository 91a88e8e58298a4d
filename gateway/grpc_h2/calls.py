"""gRPC's calls over gateway/grpc_h2/connection.py (the protocol: grpc's PROTOCOL-HTTP2.md):
each stream's method found by its `:path`, its messages framed and bounded, its deadline kept,
and the method's handler run on the event loop, as grpcio's asyncio server runs it.

The handlers are grpcio's `RpcMethodHandler`s, built as for grpcio's server (gateway/
grpc_server.py `service_handlers`, gateway/grpc_health.py), so that one servicer serves on
either server. A handler sees a context with what sluice's servicer uses of grpcio's:
`invocation_metadata()` and `abort()`.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from sluice.gateway.grpc_h2.connection import Connection
from sluice.gateway.grpc_h2.frames import CONTENT_TYPE_GRPC, STATUS_200, literal
from sluice.gateway.grpc_h2.streams import Headers, Stream
from sluice.gateway.restricted_apis import Restrictions, grpc_category, grpc_refusal

log = logging.getLogger(__name__)

Status = grpc.StatusCode
#: metadata that is the protocol's, never the application's.
RESERVED = frozenset(
    {b"te", b"content-type", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding"}
)
#: grpc-timeout's units, in seconds.
TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
#: zlib's window bits for the compressions a client may send.
WBITS = {b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
#: --grpc-infer-response-compression-level -> zlib's level (none: not compressed).
ZLIB_LEVELS = {"low": 1, "medium": 6, "high": 9}


class Aborted(Exception):
    """A handler's `context.abort(code, details)`: the call ends with that status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Context:
    """What a handler sees of its call."""

    __slots__ = ("_deadline", "_metadata")

    def __init__(self, metadata: tuple[tuple[str, Any], ...], deadline: float | None) -> None:
        self._metadata = metadata
        self._deadline = deadline

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())


class Service:
    """The methods served, by path, and what every call is held to."""

    def __init__(
        self,
        methods: dict[str, Any],
        restrictions: Restrictions,
        max_message_bytes: int,
        compression: str,
    ) -> None:
        self.methods = methods
        self.restrictions = restrictions
        self.max_message_bytes = max_message_bytes
        self.zlib_level = ZLIB_LEVELS.get(compression)

    def new_call(self, connection: Connection, stream: Stream, headers: Headers) -> Call:
        return Call(self, connection, stream, headers)


class Call:
    """One RPC: its request read and bounded, its handler run, its answer sent."""

    def __init__(
        self, service: Service, connection: Connection, stream: Stream, headers: Headers
    ) -> None:
        self.service = service
        self.connection = connection
        self.stream = stream
        self._buffer = bytearray()
        self._messages: list[bytes] = []
        self._queue: asyncio.Queue[bytes | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._headers_sent = False
        self._finished = False
        self._timed_out = False
        self._response_encoding: bytes | None = None
        self._start(headers)

    # -- the request -------------------------------------------------------------------------

    def _start(self, headers: Headers) -> None:
        fields: dict[bytes, bytes] = {}
        metadata: list[tuple[str, Any]] = []
        for name, value in headers:
            fields.setdefault(name, value)
            if name[:1] != b":" and name not in RESERVED:
                key = name.decode("latin-1")
                if key.endswith("-bin"):
                    metadata.append((key, base64.b64decode(value + b"===")))
                else:
                    metadata.append((key, value.decode("latin-1")))
        if fields.get(b":method") != b"POST" or not fields.get(b"content-type", b"").startswith(
            b"application/grpc"
        ):
            self._finish(Status.UNIMPLEMENTED, "not a gRPC request")
            return
        path = fields.get(b":path", b"").decode("latin-1")
        handler = self.service.methods.get(path)
        if handler is None:
            self._finish(Status.UNIMPLEMENTED, "Method not found!")
            return
        self.handler: Any = handler
        category = grpc_category(path)
        restriction = self.service.restrictions.get(category) if category is not None else None
        if restriction is not None and not any(
            key == restriction.header and restriction.satisfied_by(value) for key, value in metadata
        ):
            self._finish(Status.UNAVAILABLE, grpc_refusal(restriction))
            return
        self._encoding = fields.get(b"grpc-encoding", b"identity")
        accepted = fields.get(b"grpc-accept-encoding", b"")
        if self.service.zlib_level is not None and b"gzip" in accepted:
            self._response_encoding = b"gzip"
        deadline = _deadline(fields.get(b"grpc-timeout"))
        if deadline is not None:
            wait_s = max(0.0, deadline - time.monotonic())
            self._timer = asyncio.get_running_loop().call_later(wait_s, self._deadline_passed)
        self.context = Context(tuple(metadata), deadline)
        if self.handler.request_streaming:
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def data(self, chunk: bytes, end: bool) -> None:
        if self._finished:
            return
        if chunk:
            self._buffer += chunk
            if not self._split_messages():
                return
            if self._queue is None:
                self.connection.grant(self.stream, len(chunk))
        if self._queue is not None:
            for message in self._messages:
                self._queue.put_nowait(message)
            self._messages.clear()
            if end:
                self._queue.put_nowait(None)
        elif end:
            if len(self._messages) != 1 or self._buffer:
                self._finish(Status.UNIMPLEMENTED, "a unary call needs one request message")
                return
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _split_messages(self) -> bool:
        """Whole messages out of the buffer; False when the call ended on a bad one."""
        buffer = self._buffer
        while len(buffer) >= 5:
            size = int.from_bytes(buffer[1:5], "big")
            if size > self.service.max_message_bytes:
                self._fail_size(size)
                return False
            if len(buffer) < 5 + size:
                break
            compressed, message = buffer[0], bytes(buffer[5 : 5 + size])
            del buffer[: 5 + size]
            if compressed:
                inflated = self._inflate(message)
                if inflated is None:
                    return False
                message = inflated
            self._messages.append(message)
        return True

    def _inflate(self, message: bytes) -> bytes | None:
        wbits = WBITS.get(self._encoding)
        if wbits is None:
            name = self._encoding.decode("latin-1")
            self._finish(Status.UNIMPLEMENTED, f"Compression algorithm '{name}' not supported")
            return None
        limit = self.service.max_message_bytes
        try:
            inflater = zlib.decompressobj(wbits)
            data = inflater.decompress(message, limit + 1)
        except zlib.error as exc:
            self._finish(Status.INTERNAL, f"the request message did not decompress: {exc}")
            return None
        if len(data) > limit:
            self._fail_size(len(data))
            return None
        return data

    def _fail_size(self, size: int) -> None:
        limit = self.service.max_message_bytes
        self._finish(
            Status.RESOURCE_EXHAUSTED, f"Received message larger than max ({size} vs. {limit})"
        )

    async def _requests(self) -> AsyncIterator[Any]:
        assert self._queue is not None
        parse = self.handler.request_deserializer
        while (message := await self._queue.get()) is not None:
            self.connection.grant(self.stream, len(message) + 5)
            yield parse(message) if parse is not None else message

    # -- the handler ---------------------------------------------------------------------------

    async def _run(self) -> None:
        handler = self.handler
        serialize: Callable[[Any], bytes] = handler.response_serializer or (lambda m: m)
        try:
            if handler.request_streaming:
                request: Any = self._requests()
            else:
                parse = handler.request_deserializer
                message = self._messages.pop()
                request = parse(message) if parse is not None else message
            if handler.response_streaming:
                behavior = handler.stream_stream or handler.unary_stream
                async for response in behavior(request, self.context):
                    self._send(serialize(response))
                    await self.connection.drained(self.stream)
            else:
                behavior = handler.stream_unary or handler.unary_unary
                self._send(serialize(await behavior(request, self.context)))
        except Aborted as exc:
            self._finish(exc.code, exc.details)
        except asyncio.CancelledError:
            if self._timed_out:
                self._finish(Status.DEADLINE_EXCEEDED, "Deadline Exceeded")
            raise
        except Exception as exc:
            log.error("unhandled error in a gRPC call", exc_info=exc)
            self._finish(Status.UNKNOWN, f"Unexpected {type(exc)}: {exc}")
        else:
            self._finish(Status.OK, "")

    def _deadline_passed(self) -> None:
        self._timed_out = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        else:
            self._finish(Status.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def reset(self) -> None:
        """The client reset the stream, or left: the handler is cancelled."""
        self._finished = True
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    # -- the answer ----------------------------------------------------------------------------

    def _send(self, message: bytes) -> None:
        flag = b"\x00"
        if self._response_encoding is not None:
            level = self.service.zlib_level
            compressor = zlib.compressobj(level if level is not None else 6, wbits=WBITS[b"gzip"])
            message = compressor.compress(message) + compressor.flush()
            flag = b"\x01"
        if not self._headers_sent:
            self._headers_sent = True
            block = STATUS_200 + CONTENT_TYPE_GRPC
            if self._response_encoding is not None:
                block += literal(b"grpc-encoding", self._response_encoding)
            self.connection.send_headers(self.stream, block)
        self.connection.send_data(self.stream, flag + len(message).to_bytes(4, "big") + message)

    def _finish(self, code: grpc.StatusCode, message: str) -> None:
        if self._finished:
            return
        self._finished = True
        if self._timer is not None:
            self._timer.cancel()
        status = literal(b"grpc-status", str(code.value[0]).encode())
        if message:
            status += literal(b"grpc-message", _percent_encoded(message))
        if not self._headers_sent:  # Trailers-Only
            self._headers_sent = True
            status = STATUS_200 + CONTENT_TYPE_GRPC + status
        self.connection.send_headers(self.stream, status, end=True)


def _deadline(timeout: bytes | None) -> float | None:
    """grpc-timeout (digits and a unit) as a time.monotonic() deadline."""
    if not timeout or not timeout[:-1].isdigit() or timeout[-1:] not in TIMEOUT_UNITS:
        return None
    return time.monotonic() + int(timeout[:-1]) * TIMEOUT_UNITS[timeout[-1:]]


def _percent_encoded(text: str) -> bytes:
    """grpc-message's encoding: printable ASCII but '%' as is, the rest as %XX of UTF-8."""
    if text.isascii() and text.isprintable() and "%" not in text:
        return text.encode()
    out = bytearray()
    for byte in text.encode():
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += f"%{byte:02X}".encode()
    return bytes(out)
