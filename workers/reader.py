"""Reading one model's request streams: the blocking read loop and the catch-up read.

The loop reads only while the queue state says there is room (`QueueState.may_read`), on a
connection of its own, and rides out a Redis outage or a Redis that lost its consumer groups.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import redis.asyncio as aioredis
from sluice.shared import keys
from sluice.shared.redis_client import CONNECTION_ERRORS, REDIS_ERRORS
from sluice.shared.redis_wire import Wire
from sluice.workers.admission import Admission
from sluice.workers.answering import Answering
from sluice.workers.publisher import RETRY_DELAYS_S
from sluice.workers.queue_state import QueueState

log = logging.getLogger(__name__)


class StreamReader:
    """Pulls one model's requests from its streams into its queue."""

    def __init__(
        self,
        name: str,
        redis: aioredis.Redis,
        reader: aioredis.Redis,
        consumer: str,
        block_ms: int,
        state: QueueState,
        admission: Admission,
        answering: Answering,
    ) -> None:
        self.name = name
        self.redis = redis
        self.consumer = consumer
        self.state = state
        self.admission = admission
        self.answering = answering
        self.streams = admission.streams
        #: the blocking read of the streams, on the reader's own connection.
        self._reads = Wire(reader)
        self._read_command = (
            *("XREADGROUP", "GROUP", keys.WORKER_GROUP, consumer),
            *("COUNT", state.capacity, "BLOCK", block_ms, "STREAMS"),
            *self.streams,
            *[">"] * len(self.streams),
        )

    async def ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
            except aioredis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def join_groups(self) -> bool:
        """Create the consumer groups, retrying while Redis is away; False if stopped first."""
        for attempt in itertools.count():
            if self.state.stopping:
                return False
            try:
                await self.ensure_groups()
                return True
            except CONNECTION_ERRORS as exc:
                delay = RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)]
                log.warning("%s: Redis unreachable (%s); retry in %.2fs", self.name, exc, delay)
                await asyncio.sleep(delay)
        return False

    async def run(self) -> None:
        attempt = 0
        while not self.state.stopping:
            await self.state.room.wait()
            if self.state.stopping:
                break
            try:
                reply = await self._reads.call(*self._read_command)
                attempt = 0
            except aioredis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("%s: consumer group gone (Redis lost its data?)", self.name)
                if not await self.join_groups():
                    break
                continue
            except CONNECTION_ERRORS as exc:
                delay = RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)]
                log.warning("%s: read failed (%s); retry in %.2fs", self.name, exc, delay)
                attempt += 1
                await asyncio.sleep(delay)
                continue
            await self._admit(reply)
            # let the batch loop hand what was just read to an instance before this loop's
            # next read, whose Python would otherwise delay the batch's start
            await asyncio.sleep(0)

    async def catch_up(self, count: int) -> None:
        """Read what queued up while every instance was busy (see `QueueState.catch_up_count`)."""
        try:
            reply = await self.redis.xreadgroup(
                keys.WORKER_GROUP, self.consumer, dict.fromkeys(self.streams, ">"), count=count
            )
        except REDIS_ERRORS as exc:
            log.warning("%s: catch-up read failed: %s", self.name, exc)
            return
        await self._admit(reply)

    async def _admit(self, reply: object) -> None:
        rejected = self.admission.admit_reply(reply, time.time_ns())
        await self.answering.reject(rejected)
        self.state.requests_read()

    async def close(self) -> None:
        await self._reads.close()
