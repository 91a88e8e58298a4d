"""Requests a gateway holds while Redis is unreachable, within a time and a memory budget.

A Redis restart or failover lasts seconds; failing every request meanwhile turns it into a
burst of client errors. Held requests go out once Redis answers again. A request held past
the grace, or one that would take the held payload past its cap, gets a 503 with Retry-After.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from sluice.shared.protocol import Request

#: what a 503 caused by a Redis outage tells clients to wait before they retry.
RETRY_AFTER_S = 2

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class OutagePolicy:
    #: seconds a request may wait on an unreachable Redis before it gets a 503.
    grace_s: float = 15.0
    #: request payload (tensor bytes) held at most: four of the largest default bodies.
    max_held_bytes: int = 256 << 20


def payload_bytes(request: Request) -> int:
    return sum(
        t.data.nbytes if isinstance(t.data, memoryview) else len(t.data) for t in request.inputs
    )


class HeldRequests(Generic[R]):
    """Requests not yet in Redis, each with its route and the time it was first held."""

    def __init__(self, policy: OutagePolicy) -> None:
        self.policy = policy
        self.bytes = 0
        self._items: list[tuple[R, Request, float]] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, route: R, request: Request, since: float) -> bool:
        """Hold `request` (held since `since`); False when it would exceed the byte cap."""
        size = payload_bytes(request)
        if self.bytes + size > self.policy.max_held_bytes:
            return False
        self.bytes += size
        self._items.append((route, request, since))
        return True

    def expire(self, now: float) -> list[Request]:
        """Stop holding, and return, the requests held for the whole grace."""
        limit = now - self.policy.grace_s
        kept = [item for item in self._items if item[2] > limit]
        if len(kept) == len(self._items):
            return []
        expired = [request for _, request, since in self._items if since <= limit]
        self._items = kept
        self.bytes = sum(payload_bytes(request) for _, request, _ in kept)
        return expired

    def next_expiry(self) -> float | None:
        if not self._items:
            return None
        return min(since for _, _, since in self._items) + self.policy.grace_s

    def ids(self) -> set[str]:
        return {request.id for _, request, _ in self._items}

    def take(self) -> list[tuple[R, Request, float]]:
        """Every held request, in the order held; the holder is empty afterwards."""
        items, self._items = self._items, []
        self.bytes = 0
        return items
