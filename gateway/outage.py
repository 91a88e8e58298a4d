"""Requests a gateway holds while Redis is unreachable, within a time and a memory budget.

A Redis restart or failover lasts seconds; failing every request meanwhile turns it into a
burst of client errors. Held requests go out once Redis answers again. A request held past
the grace, or one that would take the held payload past its cap, gets a 503 with Retry-After.

A Redis that restarted (a new run id) may have lost the last writes before it died, even with
an append-only file, so every request still waiting is then sent again: a request may run
twice, but its id is resolved once, so its client gets one answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from sluice.shared.backoff import Backoff
from sluice.shared.protocol import Request
from sluice.shared.redis_client import CONNECTION_ERRORS

log = logging.getLogger(__name__)

#: what a 503 caused by a Redis outage tells clients to wait before they retry.
RETRY_AFTER_S = 2

R = TypeVar("R")
#: reconnect attempts start this far apart and back off up to the cap.
RETRY_FIRST_S = 0.05
RETRY_CAP_S = 0.5


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

    def add(self, route: R, request: Request, since_s: float) -> bool:
        """Hold `request` (held since `since_s`); False when it would exceed the byte cap."""
        size = payload_bytes(request)
        if self.bytes + size > self.policy.max_held_bytes:
            return False
        self.bytes += size
        self._items.append((route, request, since_s))
        return True

    def expire(self, now_s: float) -> list[Request]:
        """Stop holding, and return, the requests held for the whole grace."""
        limit_s = now_s - self.policy.grace_s
        kept = [item for item in self._items if item[2] > limit_s]
        if len(kept) == len(self._items):
            return []
        expired = [request for _, request, since_s in self._items if since_s <= limit_s]
        self._items = kept
        self.bytes = sum(payload_bytes(request) for _, request, _ in kept)
        return expired

    def next_expiry_s(self) -> float | None:
        if not self._items:
            return None
        return min(since_s for _, _, since_s in self._items) + self.policy.grace_s

    def ids(self) -> set[str]:
        return {request.id for _, request, _ in self._items}

    def take(self) -> list[tuple[R, Request, float]]:
        """Every held request, in the order held; the holder is empty afterwards."""
        items, self._items = self._items, []
        self.bytes = 0
        return items


class Sender(Protocol[R]):
    """What riding out an outage needs of the dispatcher whose requests it holds."""

    async def send_outbox(self, outbox: dict[R, list[Request]]) -> Exception | None:
        """Send in one round trip; the connection error if Redis did not answer."""

    def fail(
        self, requests: Iterable[Request], message: str, retry_after_s: int | None = None
    ) -> None: ...

    def still_waiting(self, request_id: str) -> bool: ...

    def unanswered(self) -> list[tuple[R, Request]]:
        """Requests sent and not answered, less those in the next send."""

    async def ping(self) -> None: ...

    async def server_identity(self) -> str | None:
        """The run id of the Redis server (None: not known)."""


class Outage(Generic[R]):
    """A gateway's view of Redis's reachability: the requests it holds meanwhile, and the task
    that sends them once Redis answers again."""

    def __init__(
        self, sender: Sender[R], policy: OutagePolicy, clock_s: Callable[[], float]
    ) -> None:
        self._sender = sender
        self.held: HeldRequests[R] = HeldRequests(policy)
        self._clock_s = clock_s
        #: when Redis stopped answering (None: it answers).
        self.since_s: float | None = None
        self._riding_out: asyncio.Task[None] | None = None
        #: the run id of the Redis server last seen (None: not known).
        self.server: str | None = None
        #: a new server: read the reply stream from its start, as its entry ids (another
        #: host's clock, or a stream that lost its tail) may sort before the last one read
        self.reread_replies = False

    async def learn_server(self) -> None:
        if self.server is None:
            self.server = await self._sender.server_identity()

    def hold(self, items: Iterable[tuple[R, Request, float]]) -> None:
        refused = []
        for route, request, since_s in items:
            if not self._sender.still_waiting(request.id):
                continue  # timed out or its client went away meanwhile
            if not self.held.add(route, request, since_s):
                refused.append(request)
        if refused:
            message = (
                "queue unavailable: Redis is unreachable and this gateway already holds "
                f"{self.held.bytes} bytes of requests (--max-held-bytes)"
            )
            self._sender.fail(refused, message, RETRY_AFTER_S)

    def check_server(self) -> None:
        """A connection was replaced between two calls: if Redis restarted meanwhile, the
        requests it lost must be sent again (the check is the outage task's last step)."""
        self.begin(None)

    def begin(self, error: Exception | None) -> None:
        """Start holding requests (`error`: why), and the task that waits for Redis."""
        if self.since_s is None and error is not None:
            log.warning("Redis unreachable (%s): holding requests until it is back", error)
            self.since_s = self._clock_s()
        if self._riding_out is None:
            self._riding_out = asyncio.create_task(self._ride_out())

    async def _ride_out(self) -> None:
        """Until Redis answers: expire what waited past the grace; then send what was held."""
        grace_s = self.held.policy.grace_s
        backoff = Backoff.doubling(RETRY_FIRST_S, RETRY_CAP_S)
        inflight_failed = False
        try:
            while True:
                now_s = self._clock_s()
                self._sender.fail(
                    self.held.expire(now_s),
                    f"queue unavailable: Redis unreachable for {grace_s:g} s"
                    " (--redis-outage-grace-s)",
                    RETRY_AFTER_S,
                )
                if (
                    self.since_s is not None
                    and not inflight_failed
                    and now_s - self.since_s >= grace_s
                ):
                    inflight_failed = True
                    self._fail_sent(
                        f"queue unavailable: Redis unreachable for {grace_s:g} s"
                        " before this request was answered (--redis-outage-grace-s)"
                    )
                try:
                    await self._sender.ping()
                except CONNECTION_ERRORS:
                    delay_s = backoff.next_s()
                    expiry_s = self.held.next_expiry_s()
                    pause_s = (
                        delay_s if expiry_s is None else max(0.0, min(delay_s, expiry_s - now_s))
                    )
                    await asyncio.sleep(pause_s)
                    continue
                if await self._send_held():
                    return
        finally:
            self._riding_out = None

    async def _send_held(self) -> bool:
        """Redis answers: send what is held (and, after a restart, every unanswered request
        again). True once nothing is held; the outage is then over."""
        server = await self._sender.server_identity()
        restarted = server is None or server != self.server
        held = self.held.take()
        if restarted:
            self.reread_replies = True
            if self.server is not None:
                log.warning("Redis restarted: sending every unanswered request again")
            pending = {request.id for _, request, _ in held}
            now_s = self._clock_s()
            held += [
                (route, request, now_s)
                for route, request in self._sender.unanswered()
                if request.id not in pending
            ]
        self.server = server
        while held:
            outbox: dict[R, list[Request]] = defaultdict(list)
            for route, request, _ in held:
                if self._sender.still_waiting(request.id):  # not timed out or cancelled
                    outbox[route].append(request)
            error = await self._sender.send_outbox(outbox)
            if error is not None:
                self.hold(held)
                return False
            held = self.held.take()  # arrived while the last ones were sent
        if self.since_s is not None:
            log.info("Redis reachable again: held requests sent")
        self.since_s = None
        return True

    def _fail_sent(self, message: str) -> None:
        """Fail the requests sent before the outage (those held have a grace of their own)."""
        held = self.held.ids()
        self._sender.fail(
            (request for _, request in self._sender.unanswered() if request.id not in held),
            message,
            RETRY_AFTER_S,
        )

    async def close(self) -> None:
        """Stop waiting for Redis; fail what is held."""
        if self._riding_out is not None:
            self._riding_out.cancel()
            await asyncio.gather(self._riding_out, return_exceptions=True)
        self._sender.fail(
            (request for _, request, _ in self.held.take()),
            "queue unavailable: the gateway stopped while Redis was unreachable",
            RETRY_AFTER_S,
        )
