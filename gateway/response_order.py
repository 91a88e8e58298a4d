"""A decoupled request's responses put back in order, each delivered once.

Responses carry their sequence number (shared/protocol.py). Those of one request published by
one worker arrive in order on one reply stream, but a request taken over from a worker that
died runs again from its start on another, and numbers its responses from 0 again: the ones
already delivered are skipped, so a client never sees a response twice (a model that does not
generate the same responses again would show its new ones from where the old run stopped).
A response ahead of its turn waits for the ones before it.

Responses wait here until the request's client takes them; a model answers at its own pace,
whether or not the client reads. Past `max_held_bytes` of them the order overflows: it drops
what it holds and takes nothing more, and the request is stopped (gateway/dispatcher.py).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from sluice.shared.protocol import Result


class ResponseOrder:
    """One streamed request's responses, ready to be taken in sequence order."""

    def __init__(
        self,
        max_held_bytes: int | None = None,
        on_overflow: Callable[[], None] | None = None,
    ) -> None:
        self.next_seq = 0
        self._max_held_bytes = max_held_bytes
        #: called once when the order overflows, while its consumer may still be away.
        self._on_overflow = on_overflow
        #: the outputs' bytes of the responses held (ready or ahead of their turn).
        self.held_bytes = 0
        #: more than `max_held_bytes` were held: the client did not take them in time.
        self.overflowed = False
        #: responses that arrived ahead of their turn, by number.
        self._ahead: dict[int, Result] = {}
        self.ready: deque[Result] = deque()
        #: set whenever something is ready (or the request ended otherwise).
        self.wake = asyncio.Event()
        #: the final response was delivered (nothing after it is).
        self.finished = False

    def receive(self, result: Result) -> None:
        """A response off the reply stream: ready if its turn, held if early, dropped if
        already delivered (or after the final one)."""
        seq = result.seq
        if self.finished or self.overflowed or seq is None or seq < self.next_seq:
            return
        self._ahead[seq] = result
        self.held_bytes += _size(result)
        if self._max_held_bytes is not None and self.held_bytes > self._max_held_bytes:
            self.overflowed = True
            self._ahead.clear()
            self.ready.clear()
            self.held_bytes = 0
            self.wake.set()
            if self._on_overflow is not None:
                self._on_overflow()
            return
        while not self.finished and (next_one := self._ahead.pop(self.next_seq, None)):
            self.ready.append(next_one)
            self.next_seq += 1
            self.finished = next_one.final
        if self.finished:
            self._ahead.clear()
        if self.ready:
            self.wake.set()

    def take(self) -> Result:
        """The next response in order (one must be ready)."""
        result = self.ready.popleft()
        self.held_bytes -= _size(result)
        return result


def _size(result: Result) -> int:
    return sum(memoryview(tensor.data).nbytes for tensor in result.outputs)
