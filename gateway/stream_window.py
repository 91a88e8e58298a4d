"""The bounds of one gRPC `ModelStreamInfer` stream, so that a client that sends without reading
costs the gateway a bounded amount of memory.

A stream takes its next request only while fewer than `max_requests` of its requests are in
flight (read, and not yet every response handed to grpc); past that it stops reading, and
HTTP/2 flow control holds the client back. Responses wait for the client in a queue of at most
`max_queued_bytes` (one response always fits, however large): a request whose responses do not
fit waits, and so stops taking its model's further responses off the reply stream, which the
dispatcher bounds in turn (gateway/response_order.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

#: what the queue hands the writer: a response to send, or the end of one request's responses.
REQUEST_DONE = object()


@dataclass(slots=True)
class StreamLoad:
    """This gateway's streams together, as its metrics port shows them: now, and the most
    since it started."""

    in_flight: int = 0
    in_flight_max: int = 0
    queued_bytes: int = 0
    queued_bytes_max: int = 0

    def add(self, requests: int, queued_bytes: int) -> None:
        self.in_flight += requests
        self.queued_bytes += queued_bytes
        self.in_flight_max = max(self.in_flight_max, self.in_flight)
        self.queued_bytes_max = max(self.queued_bytes_max, self.queued_bytes)


class StreamWindow:
    """One stream's requests in flight and the responses queued for its client."""

    def __init__(self, max_requests: int, max_queued_bytes: int, load: StreamLoad) -> None:
        self._slots = asyncio.Semaphore(max_requests)
        self._max_bytes = max_queued_bytes
        self._load = load
        self._queue: deque[tuple[Any, int]] = deque()
        self._bytes = 0
        self._requests = 0
        self._ready = asyncio.Event()
        self._space = asyncio.Event()
        #: the stream ended: a request task not yet cancelled queues nothing more.
        self._closed = False

    async def admit(self) -> None:
        """Wait for a request's slot before the stream's next request is read."""
        await self._slots.acquire()
        self._requests += 1
        self._load.add(1, 0)

    def leave(self) -> None:
        """A request's responses are all sent (or it was never started): its slot is free."""
        self._requests -= 1
        self._load.add(-1, 0)
        self._slots.release()

    async def put(self, response: Any, size: int) -> None:
        """Queue a response for the client, waiting while the queue is full."""
        while self._queue and self._bytes + size > self._max_bytes:
            self._space.clear()
            await self._space.wait()
        self._append(response, size)

    def done(self) -> None:
        """The end of one request's responses: its slot is freed once those before are sent."""
        self._append(REQUEST_DONE, 0)

    def _append(self, item: Any, size: int) -> None:
        if self._closed:
            return
        self._queue.append((item, size))
        self._bytes += size
        self._load.add(0, size)
        self._ready.set()

    def end(self) -> None:
        """No request is left to answer: the stream ends after what is queued."""
        self._append(None, 0)

    async def get(self) -> Any:
        """The next response to send, REQUEST_DONE, or None at the stream's end."""
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        item, size = self._queue.popleft()
        self._bytes -= size
        self._load.add(0, -size)
        self._space.set()
        return item

    def close(self) -> None:
        """The stream ended: what it still held leaves the gateway's figures."""
        self._load.add(-self._requests, -self._bytes)
        self._requests = self._bytes = 0
        self._queue.clear()
        self._closed = True
