"""One client's HTTP/2 connection, as a gRPC server needs it (RFC 9113), on asyncio.

The frames are read and written here and flow control is kept both ways: what the client may
send is granted as the calls take it (`grant`), so that a call that stops reading stops its
client, and what is sent waits for the client's windows. Header blocks are decoded with the
`hpack` package's decoder (HPACK's dynamic table and Huffman code); what the server sends is
encoded without state (frames.literal). Everything a client sends is bounded: frames by the
size advertised, header lists by MAX_HEADER_LIST, streams at once by MAX_STREAMS, and what
each stream buffers by its window. Each stream's call is the `Handler`'s (gateway/grpc_h2/
calls.py); writes made while frames are read, or in one turn of the loop, leave together.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import cast

import hpack
from hpack.exceptions import HPACKError
from sluice.gateway.grpc_h2.frames import (
    ACK,
    CANCEL,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_MAX_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INTERNAL_ERROR,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    WINDOW_UPDATE,
    frame,
    goaway,
    rst_stream,
    settings_frame,
    window_update,
)
from sluice.gateway.grpc_h2.streams import Handler, Headers, Stream

log = logging.getLogger(__name__)

#: what this server advertises: streams at once, the largest frame, each stream's window.
MAX_STREAMS = 1024
MAX_FRAME = 1 << 20
STREAM_WINDOW = 1 << 20
#: the connection's window: what all its streams may have in flight together.
CONNECTION_WINDOW = 16 << 20
#: a header list (decoded) and a header block (encoded, HEADERS and CONTINUATION) at most.
MAX_HEADER_LIST = 64 << 10
#: bytes a stream may have queued for a client that does not read before `drained` waits.
SEND_BUFFER = 1 << 20
#: streams a client may reset in a second (each started a call): more is an attack on the
#: server's work, not a client cancelling (HTTP/2 "rapid reset").
RESETS_PER_S = 1000


class ConnectionError_(Exception):
    """The connection must end: a GOAWAY with `code` is sent, and it closes."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Connection(asyncio.Protocol):
    """The server side of one HTTP/2 connection; `new_handler(connection, stream, headers)`
    starts each stream's call."""

    def __init__(
        self,
        new_handler: Callable[[Connection, Stream, Headers], Handler],
        connections: set[Connection],
    ) -> None:
        self._new_handler = new_handler
        self._connections = connections
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._preface_seen = False
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = MAX_HEADER_LIST
        self.streams: dict[int, Stream] = {}
        self._last_stream_id = 0
        #: a header block in pieces: (stream id, flags of its HEADERS, the pieces so far).
        self._continuing: tuple[int, int, bytearray] | None = None
        self._peer_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_MAX_FRAME
        self._send_window = DEFAULT_WINDOW
        self._received_ungranted = 0
        self._receive_window = CONNECTION_WINDOW
        #: streams the client reset in the current second, and when that second began: a
        #: client that opens and resets streams faster than RESETS_PER_S is sent away.
        self._resets = 0
        self._resets_since = 0.0
        self._blocked: dict[int, Stream] = {}
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.closing = False
        self.idle = asyncio.Event()

    # -- asyncio ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self._connections.add(self)
        settings = {
            SETTINGS_MAX_CONCURRENT_STREAMS: MAX_STREAMS,
            SETTINGS_INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            SETTINGS_MAX_FRAME_SIZE: MAX_FRAME,
            SETTINGS_MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
            SETTINGS_ENABLE_PUSH: 0,
        }
        self._write(settings_frame(settings))
        self._write(window_update(0, CONNECTION_WINDOW - DEFAULT_WINDOW))

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        self.transport = None
        self._resumed.set()
        for stream in list(self.streams.values()):
            self._forget(stream)
        self.idle.set()

    def pause_writing(self) -> None:
        self._paused = True
        self._resumed.clear()

    def resume_writing(self) -> None:
        self._paused = False
        self._resumed.set()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        try:
            if not self._preface_seen:
                if len(buffer) < len(PREFACE):
                    return
                if buffer[: len(PREFACE)] != PREFACE:
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                del buffer[: len(PREFACE)]
                self._preface_seen = True
            self._read_frames()
        except ConnectionError_ as exc:
            self._fail(exc.code, str(exc))
        except Exception as exc:  # a bug: this connection ends, the others go on
            log.error("gRPC connection failed", exc_info=exc)
            self._fail(INTERNAL_ERROR, "internal error")
        self._flush()

    # -- frames in ---------------------------------------------------------------------------

    def _read_frames(self) -> None:
        buffer = self._buffer
        position, size = 0, len(buffer)
        try:
            while size - position >= 9:
                length = int.from_bytes(buffer[position : position + 3], "big")
                if length > MAX_FRAME:
                    raise ConnectionError_(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                end = position + 9 + length
                if end > size:
                    break
                kind, flags = buffer[position + 3], buffer[position + 4]
                stream_id = int.from_bytes(buffer[position + 5 : position + 9], "big") & MAX_WINDOW
                payload = bytes(buffer[position + 9 : end])
                position = end
                self._frame(kind, flags, stream_id, payload)
        finally:
            del buffer[:position]

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuing is not None and kind != CONTINUATION:
            raise ConnectionError_(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        else:
            self._control(kind, flags, stream_id, payload)

    def _control(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == PING:
            if len(payload) != 8:
                raise ConnectionError_(FRAME_SIZE_ERROR, "a PING of the wrong size")
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            stream = self.streams.get(stream_id)
            if stream is not None:
                self._count_reset()
                self._forget(stream)
        elif kind == GOAWAY:
            self.closing = True
            self._close_if_idle()
        elif kind == PUSH_PROMISE:
            raise ConnectionError_(PROTOCOL_ERROR, "a client may not push")
        # PRIORITY and unknown frames are ignored, as the protocol allows

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        self._receive_window -= len(payload)
        if self._receive_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "data past the connection's window")
        self._received_ungranted += len(payload)
        if self._received_ungranted >= CONNECTION_WINDOW // 2:
            self._write(window_update(0, self._received_ungranted))
            self._receive_window += self._received_ungranted
            self._received_ungranted = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_ended:
            if stream_id > self._last_stream_id:
                raise ConnectionError_(PROTOCOL_ERROR, "DATA on a stream never opened")
            return  # a stream closed or reset meanwhile: its data is dropped
        stream.receive_window -= len(payload)
        if stream.receive_window < 0:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "data past a stream's window")
        if flags & PADDED:
            padded = len(payload)
            payload = _unpadded(payload)
            self.grant(stream, padded - len(payload))  # padding is no call's to take
        end = bool(flags & END_STREAM)
        stream.remote_ended = end
        if stream.handler is not None:
            stream.handler.data(payload, end)
        self._close_if_done(stream)

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on stream 0")
        if flags & PADDED:
            payload = _unpadded(payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(stream_id, flags, payload)
        else:
            self._continuing = (stream_id, flags, bytearray(payload))

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._continuing is None or self._continuing[0] != stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION out of place")
        block = self._continuing[2]
        block += payload
        if len(block) > MAX_HEADER_LIST:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "a header block too large")
        if flags & END_HEADERS:
            _, first_flags, _ = self._continuing
            self._continuing = None
            self._header_block(stream_id, first_flags, bytes(block))

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            headers = cast(Headers, self._decoder.decode(block, raw=True))
        except HPACKError as exc:
            raise ConnectionError_(COMPRESSION_ERROR, f"a header block: {exc}") from None
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client: the end of its side
            if flags & END_STREAM and not stream.remote_ended:
                stream.remote_ended = True
                if stream.handler is not None:
                    stream.handler.data(b"", True)
                self._close_if_done(stream)
            return
        if stream_id % 2 == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "a client's stream with an even id")
        if stream_id <= self._last_stream_id:
            return  # a closed stream's late headers, dropped as its data is
        self._last_stream_id = stream_id
        if self.closing or len(self.streams) >= MAX_STREAMS:
            self._write(rst_stream(stream_id, REFUSED_STREAM))
            return
        stream = Stream(stream_id, self._peer_window, STREAM_WINDOW)
        stream.remote_ended = bool(flags & END_STREAM)
        self.streams[stream_id] = stream
        self.idle.clear()
        stream.handler = self._new_handler(self, stream, headers)
        if stream.remote_ended and stream.id in self.streams:
            stream.handler.data(b"", True)

    def _settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS of the wrong size")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "a window past 2^31-1")
                delta, self._peer_window = value - self._peer_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME <= value <= 16_777_215:
                    raise ConnectionError_(PROTOCOL_ERROR, "a maximum frame size out of range")
                self._peer_max_frame = value
        self._write(frame(SETTINGS, ACK, 0))
        self._send_blocked()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "a WINDOW_UPDATE of the wrong size")
        increment = int.from_bytes(payload, "big") & MAX_WINDOW
        if stream_id == 0:
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "the connection window overflowed")
            self._send_blocked()
            return
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.send_window += increment
            self._send_pending(stream)

    def _count_reset(self) -> None:
        now = asyncio.get_running_loop().time()
        if now - self._resets_since >= 1.0:
            self._resets, self._resets_since = 0, now
        self._resets += 1
        if self._resets > RESETS_PER_S:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "too many streams reset")

    # -- what the calls do -----------------------------------------------------------------------

    def grant(self, stream: Stream, size: int) -> None:
        """The call took `size` bytes of the stream's body: the client may send as much more."""
        if stream.remote_ended or stream.id not in self.streams:
            return
        stream.ungranted += size
        if stream.ungranted >= STREAM_WINDOW // 4:
            self._write(window_update(stream.id, stream.ungranted))
            stream.receive_window += stream.ungranted
            stream.ungranted = 0
            self._schedule_flush()

    def send_headers(self, stream: Stream, block: bytes, end: bool = False) -> None:
        if stream.id not in self.streams or stream.local_ended:
            return
        if end:
            if stream.pending:  # trailers wait for the data before them
                stream.trailers = block
                return
            stream.local_ended = True
        self._write(frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), stream.id, block))
        if end:
            self._close_if_done(stream, sent_end=True)
        self._schedule_flush()

    def send_data(self, stream: Stream, data: bytes) -> None:
        if stream.id not in self.streams or stream.local_ended or not data:
            return
        stream.pending.append(memoryview(data))
        stream.pending_bytes += len(data)
        self._send_pending(stream)
        self._schedule_flush()

    async def drained(self, stream: Stream) -> None:
        """Returns once the stream's client has taken most of what was sent on it."""
        while stream.pending_bytes > SEND_BUFFER and stream.id in self.streams:
            stream.drained = asyncio.Event()
            await stream.drained.wait()
        if self._paused:
            await self._resumed.wait()

    def reset(self, stream: Stream, code: int = CANCEL) -> None:
        if stream.id in self.streams:
            self._write(rst_stream(stream.id, code))
            self._forget(stream, notify=False)
            self._schedule_flush()

    def close(self) -> None:
        """Take no new stream (GOAWAY); close once the streams in flight end."""
        if not self.closing:
            self.closing = True
            self._write(goaway(self._last_stream_id, NO_ERROR))
            self._schedule_flush()
        self._close_if_idle()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- frames out --------------------------------------------------------------------------

    def _send_pending(self, stream: Stream) -> None:
        while stream.pending and stream.send_window > 0 and self._send_window > 0:
            piece = stream.pending[0]
            size = min(len(piece), stream.send_window, self._send_window, self._peer_max_frame)
            self._write(frame(DATA, 0, stream.id, bytes(piece[:size])))
            stream.send_window -= size
            self._send_window -= size
            stream.pending_bytes -= size
            if size == len(piece):
                stream.pending.pop(0)
            else:
                stream.pending[0] = piece[size:]
        if stream.pending:
            self._blocked[stream.id] = stream
            return
        self._blocked.pop(stream.id, None)
        if stream.drained is not None:
            stream.drained.set()
        if stream.trailers is not None:
            block, stream.trailers = stream.trailers, None
            stream.local_ended = True
            self._write(frame(HEADERS, END_HEADERS | END_STREAM, stream.id, block))
            self._close_if_done(stream, sent_end=True)

    def _send_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._send_window <= 0:
                break
            self._send_pending(stream)
        self._schedule_flush()

    def _write(self, data: bytes) -> None:
        self._out.append(data)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._out:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and self.transport is not None:
            self.transport.write(b"".join(self._out))
        self._out.clear()

    # -- streams ending ----------------------------------------------------------------------

    def _close_if_done(self, stream: Stream, sent_end: bool = False) -> None:
        if stream.local_ended and not stream.remote_ended and sent_end:
            # the call is over before the client's side: it need not send more
            self._write(rst_stream(stream.id, NO_ERROR))
            stream.remote_ended = True
        if stream.local_ended and stream.remote_ended:
            self._forget(stream, notify=False)

    def _forget(self, stream: Stream, notify: bool = True) -> None:
        if self.streams.pop(stream.id, None) is None:
            return
        self._blocked.pop(stream.id, None)
        if stream.drained is not None:
            stream.drained.set()
        if notify and stream.handler is not None:
            stream.handler.reset()
        if not self.streams:
            self.idle.set()
            self._close_if_idle()

    def _close_if_idle(self) -> None:
        if self.closing and not self.streams and self.transport is not None:
            self._flush()
            self.transport.close()

    def _fail(self, code: int, message: str) -> None:
        log.debug("gRPC connection closed: %s", message)
        self._write(goaway(self._last_stream_id, code, message.encode()[:256]))
        self._flush()
        if self.transport is not None:
            self.transport.close()


def _unpadded(payload: bytes) -> bytes:
    if not payload:
        raise ConnectionError_(PROTOCOL_ERROR, "a padded frame without its pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise ConnectionError_(PROTOCOL_ERROR, "padding longer than its frame")
    return payload[1 : len(payload) - pad]
