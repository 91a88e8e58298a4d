"""Closed-loop HTTP load that records, per request, whether it was sent and what came back.

For shutdown tests: a request whose bytes were written before the stop signal must get an
answer; one written after may find the port closed. Each connection's thread stops at its
first request that could not be sent (the gateway is gone), so nothing spins on a dead port.
"""

from __future__ import annotations

import http.client
import math
import threading
import time
from dataclasses import dataclass

#: a request still unanswered this long counts as hung.
ANSWER_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Outcome:
    #: time.monotonic() once the request was written; inf when it could not be sent.
    sent_at: float
    #: the HTTP status, or None when no response came.
    status: int | None
    body: bytes = b""
    error: str = ""


class ClosedLoopLoad:
    """`concurrency` connections, each sending its next request when the last is answered."""

    def __init__(self, address: str, path: str, body: bytes, concurrency: int) -> None:
        self.host, port = address.rsplit(":", 1)
        self.port = int(port)
        self.path = path
        self.body = body
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._connection, daemon=True) for _ in range(concurrency)
        ]

    @property
    def answered(self) -> int:
        return sum(o.status is not None for o in self.outcomes)

    def start(self) -> ClosedLoopLoad:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[Outcome]:
        """Stop sending; every request in flight is waited for (up to ANSWER_TIMEOUT_S)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(ANSWER_TIMEOUT_S + 5)
            assert not thread.is_alive(), "a request hung"
        return list(self.outcomes)

    def _record(self, outcome: Outcome) -> None:
        with self._lock:
            self.outcomes.append(outcome)

    def _connection(self) -> None:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=ANSWER_TIMEOUT_S)
        headers = {"Content-Type": "application/json"}
        try:
            while not self._stop.is_set():
                sent_at = math.inf
                try:
                    connection.request("POST", self.path, self.body, headers)
                    sent_at = time.monotonic()
                    response = connection.getresponse()
                    self._record(Outcome(sent_at, response.status, response.read()))
                except (OSError, http.client.HTTPException) as exc:
                    self._record(Outcome(sent_at, None, error=repr(exc)))
                    if sent_at == math.inf:
                        return  # nothing listens any more
                    connection.close()
        finally:
            connection.close()
