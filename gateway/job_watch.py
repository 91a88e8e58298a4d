"""Waiting for jobs: one pub/sub subscription per gateway, fanned out to every waiter.

Long-polls (`GET /v2/jobs/{id}?wait=S`) and event streams (`/v2/jobs/{id}/events`) wait for a
job to change. Each used to block an XREAD of its own, holding a Redis connection per waiter;
now one connection subscribes to every job's channel (PSUBSCRIBE), on which workers and
gateways announce each change after storing it (shared/keys.py job_channel), and wakes the
waiters of that job, which then read the job again. A waiter registers before it reads, so no
announcement falls between its read and its wait. The waiters are bounded; while the
subscription is down (a Redis outage), each waits out its own deadline, and all look again once
it is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sluice.gateway.outage import RETRY_AFTER_S, RETRY_CAP_S, RETRY_FIRST_S
from sluice.shared import keys
from sluice.shared.backoff import Backoff
from sluice.shared.errors import Unavailable
from sluice.shared.redis_client import REDIS_ERRORS

log = logging.getLogger(__name__)

#: jobs' channels share this prefix; the job id follows it.
CHANNEL_PREFIX = keys.job_channel("")
#: waiters a gateway holds at once (long-polls and event streams); one more is a 503.
MAX_WAITERS = 10_000


class JobWatch:
    """The job waiters of one gateway, woken from its one subscription."""

    def __init__(self, redis: Any, max_waiters: int = MAX_WAITERS) -> None:
        self._redis = redis
        self._max_waiters = max_waiters
        self._waiters: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self.count = 0
        #: set while the subscription is on (announcements reach the waiters).
        self.listening = asyncio.Event()

    @contextmanager
    def watching(
        self, job_id: str, gone: asyncio.Future[None] | None = None
    ) -> Iterator[asyncio.Event]:
        """An event set whenever `job_id` may have changed, for as long as the block runs, and
        when `gone` (the waiting client's disconnect) resolves."""
        if self.count >= self._max_waiters:
            message = f"too many requests wait for jobs on this gateway ({self._max_waiters})"
            raise Unavailable(message, RETRY_AFTER_S)
        changed = asyncio.Event()
        waiters = self._waiters[job_id]
        waiters.add(changed)
        self.count += 1

        def left(_: object) -> None:
            changed.set()

        if gone is not None:
            gone.add_done_callback(left)
        try:
            yield changed
        finally:
            if gone is not None:
                gone.remove_done_callback(left)
            self.count -= 1
            waiters.discard(changed)
            if not waiters:
                self._waiters.pop(job_id, None)

    async def run(self) -> None:
        """Listen until cancelled, resubscribing after a lost connection."""
        backoff = Backoff.doubling(RETRY_FIRST_S, RETRY_CAP_S)
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.psubscribe(CHANNEL_PREFIX + "*")
                async for message in pubsub.listen():
                    backoff.reset()
                    self._hear(message)
            except REDIS_ERRORS as exc:
                log.warning("job events subscription lost (%s); resubscribing", exc)
            finally:
                self.listening.clear()
                await pubsub.aclose()
            self._wake_all()  # what was announced meanwhile is read again
            await asyncio.sleep(backoff.next_s())

    def _hear(self, message: dict[str, Any]) -> None:
        if message["type"] == "psubscribe":  # (re)subscribed: look again at every job
            self.listening.set()
            self._wake_all()
            return
        if message["type"] != "pmessage":
            return
        channel = message["channel"]
        text = channel.decode() if isinstance(channel, bytes) else str(channel)
        for changed in self._waiters.get(text.removeprefix(CHANNEL_PREFIX), ()):
            changed.set()

    def _wake_all(self) -> None:
        for waiters in self._waiters.values():
            for changed in waiters:
                changed.set()
