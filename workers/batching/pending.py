"""The requests a worker has read but not started: ordered by priority, expired on time.

Order is Triton's: priority level first (1 is highest), then requests that timed out with the
DELAY action behind the others of their level, then arrival.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.shared.errors import SluiceError, Unavailable
from sluice.shared.protocol import Request
from sluice.workers.batching.batcher import Pending


@dataclass(slots=True)
class Queued:
    request: Request
    stream: str
    entry_id: bytes
    pending: Pending
    level: int = 0
    seq: int = 0
    #: Triton's queue timeout (0: none); what happens then depends on `reject_on_timeout`.
    timeout_at_ns: int = 0
    reject_on_timeout: bool = True
    #: the request's own deadline for queue + execution (0: none).
    deadline_at_ns: int = 0
    delayed: bool = False
    #: a null request of a sequence batch (an empty slot's, workers/sequences/): it runs with
    #: the batch and its answer is dropped.
    filler: bool = False
    #: when a traced request was read from its stream (wall-clock ns; 0: not traced).
    read_ns: int = 0

    def order(self) -> tuple[int, bool, int]:
        return (self.level, self.delayed, self.seq)


@dataclass(slots=True)
class PendingQueue:
    items: list[Queued] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: Queued) -> None:
        bisect.insort(self.items, item, key=Queued.order)

    def pendings(self) -> list[Pending]:
        return [q.pending for q in self.items]

    def units(self) -> int:
        return sum(q.pending.batch_size for q in self.items)

    def take(self, indices: Sequence[int]) -> list[Queued]:
        chosen = set(indices)
        taken = [self.items[i] for i in indices]
        self.items = [q for i, q in enumerate(self.items) if i not in chosen]
        return taken

    def cancel(self, request_id: str) -> Queued | None:
        for index, item in enumerate(self.items):
            if item.request.id == request_id:
                return self.items.pop(index)
        return None

    def expire(self, now_ns: int) -> list[tuple[Queued, SluiceError, str]]:
        """Remove requests past their deadline or REJECT timeout; delay the DELAY ones.

        Returns (request, error, failure reason) for each removed request.
        """
        expired: list[tuple[Queued, SluiceError, str]] = []
        kept: list[Queued] = []
        resort = False
        for item in self.items:
            if item.deadline_at_ns and now_ns >= item.deadline_at_ns:
                expired.append((item, Unavailable("Request deadline exceeded"), "REJECTED"))
            elif item.timeout_at_ns and now_ns >= item.timeout_at_ns and not item.delayed:
                if item.reject_on_timeout:
                    expired.append((item, Unavailable("Request timeout expired"), "REJECTED"))
                    continue
                item.delayed = resort = True
                kept.append(item)
            else:
                kept.append(item)
        if resort:
            kept.sort(key=Queued.order)
        self.items = kept
        return expired

    def next_expiry_ns(self) -> int | None:
        """When `expire` may next have something to do."""
        times = [
            t
            for q in self.items
            for t in (q.deadline_at_ns, 0 if q.delayed else q.timeout_at_ns)
            if t
        ]
        return min(times, default=None)
