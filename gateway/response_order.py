"""A decoupled request's responses put back in order, each delivered once.

Responses carry their sequence number (shared/protocol.py). Those of one request published by
one worker arrive in order on one reply stream, but a request taken over from a worker that
died runs again from its start on another, and numbers its responses from 0 again: the ones
already delivered are skipped, so a client never sees a response twice (a model that does not
generate the same responses again would show its new ones from where the old run stopped).
A response ahead of its turn waits for the ones before it.
"""

from __future__ import annotations

import asyncio
from collections import deque

from sluice.shared.protocol import Result


class ResponseOrder:
    """One streamed request's responses, ready to be taken in sequence order."""

    def __init__(self) -> None:
        self.next_seq = 0
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
        if self.finished or seq is None or seq < self.next_seq:
            return
        self._ahead[seq] = result
        while not self.finished and (next_one := self._ahead.pop(self.next_seq, None)):
            self.ready.append(next_one)
            self.next_seq += 1
            self.finished = next_one.final
        if self.finished:
            self._ahead.clear()
        if self.ready:
            self.wake.set()
