"""An HTTP/2 stream as the connection keeps it (gateway/grpc_h2/connection.py), and what runs
the call on it (gateway/grpc_h2/calls.py)."""

from __future__ import annotations

import asyncio
from typing import Protocol

#: a header list as decoded: (name, value) bytes, in order.
Headers = list[tuple[bytes, bytes]]


class Handler(Protocol):
    """What runs a stream's call (gateway/grpc_h2/calls.py)."""

    def data(self, chunk: bytes, end: bool) -> None:
        """Bytes of the request body as they arrive (`end`: the client is done sending)."""

    def reset(self) -> None:
        """The stream is gone (the client reset it, or the connection closed)."""


class Stream:
    """One stream: its send window and what waits for it, and whether either side ended."""

    __slots__ = (
        "drained",
        "handler",
        "id",
        "local_ended",
        "pending",
        "pending_bytes",
        "receive_window",
        "remote_ended",
        "send_window",
        "trailers",
        "ungranted",
    )

    def __init__(self, stream_id: int, send_window: int, receive_window: int) -> None:
        self.id = stream_id
        self.handler: Handler | None = None
        self.send_window = send_window
        self.pending: list[memoryview] = []
        self.pending_bytes = 0
        self.trailers: bytes | None = None
        self.remote_ended = False
        self.local_ended = False
        #: bytes received and taken by the call, not yet granted back to the client.
        self.ungranted = 0
        #: what the client may still send before a grant: past it, it broke flow control.
        self.receive_window = receive_window
        self.drained: asyncio.Event | None = None
