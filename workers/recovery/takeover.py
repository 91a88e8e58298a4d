"""Crash recovery for one model queue: keep our entries claimed, take over a dead worker's.

Every round keeps the entries this worker holds alive, claims entries idle too long while
there is room to run them (each then runs in a batch of its own), splits multi-request
entries so one poison request cannot take the others down, and dead-letters a request
delivered too often.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from sluice.shared.protocol import ProtocolError, Result, decode_requests
from sluice.shared.redis_client import REDIS_ERRORS
from sluice.workers.batching.admission import Admission, Rejected
from sluice.workers.batching.answering import Answering
from sluice.workers.batching.batcher import Pending
from sluice.workers.batching.pending import Queued
from sluice.workers.batching.queue_state import QueueState
from sluice.workers.recovery.recovery import STALE_CONSUMER_PERIODS, Claimed, Recovery

log = logging.getLogger(__name__)


class Takeover:
    """The recovery loop of one model queue, one `Recovery` per stream."""

    def __init__(
        self,
        name: str,
        recoveries: list[Recovery],
        state: QueueState,
        admission: Admission,
        answering: Answering,
    ) -> None:
        self.name = name
        self.recoveries = recoveries
        self.state = state
        self.admission = admission
        self.answering = answering
        self.publisher = answering.publisher

    async def run(self) -> None:
        for rounds in itertools.count(1):
            await asyncio.sleep(self.recoveries[0].interval_s)
            if self.state.stopping:
                return
            try:
                for recovery in self.recoveries:
                    await recovery.keep_alive(self.publisher.held(recovery.stream))
                    if self.state.may_read:
                        claimed = await recovery.claim(self.state.capacity)
                        await self._take_over(recovery, claimed)
                    if rounds % STALE_CONSUMER_PERIODS == 0:
                        await recovery.prune_consumers()
            except REDIS_ERRORS as exc:
                log.warning("%s: recovery round failed: %s", self.name, exc)

    async def _take_over(self, recovery: Recovery, claimed: list[Claimed]) -> None:
        now_ns = time.time_ns()
        stream = recovery.stream
        rejected: list[Rejected] = []
        for item in claimed:
            key = (stream, item.entry_id)
            if key in self.publisher.unanswered or key in self.publisher.unacked:
                continue  # ours: in hand, or answered and waiting for Redis to take the ack
            try:
                requests = decode_requests(item.fields) if item.fields else []
            except ProtocolError as exc:
                await recovery.dead_letter(item, f"undecodable: {exc}")
                requests = []
            if not requests:
                await self.publisher.publish([], [], extra_acks=[(stream, item.entry_id)])
            elif len(requests) > 1:
                await recovery.split(item.entry_id, requests)
            elif recovery.too_often(item):
                reason = (
                    f"request {requests[0].id} was delivered {item.deliveries} times and its "
                    f"worker died each time; moved to dead-letter stream {recovery.dead_stream}"
                )
                await recovery.dead_letter(item, reason)
                self.publisher.hold(stream, item.entry_id, 1)
                level = self.admission.streams[stream]
                queued = Queued(requests[0], stream, item.entry_id, Pending(None, 1, now_ns), level)
                rejected.append((queued, Result(requests[0].id, error=("INTERNAL", reason))))
            else:
                rejected += self.admission.queue(
                    stream, item.entry_id, requests, now_ns, alone=True
                )
        await self.answering.reject(rejected)
        self.state.requests_read()
