"""Reading one model's request streams: the blocking read loops and the catch-up read.

A loop reads only while the queue state says there is room (`QueueState.may_read`), on a
connection of its own, and rides out a Redis outage or a Redis that lost its consumer groups.
A partitioned model (shared/partitions.py) has a loop per partition, each reading its share of
the room, since one read cannot span the slots (shards) of several partitions.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from sluice.shared import keys
from sluice.shared.backoff import Backoff
from sluice.shared.partitions import share
from sluice.shared.redis_client import CONNECTION_ERRORS, REDIS_ERRORS, UNREACHABLE_RETRY_DELAYS_S
from sluice.shared.redis_wire import Wire
from sluice.workers.batching.admission import Admission
from sluice.workers.batching.answering import Answering
from sluice.workers.batching.queue_state import QueueState

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
        by_partition: dict[int, list[str]] = {}
        for stream in self.streams:
            by_partition.setdefault(keys.partition_of(stream), []).append(stream)
        #: each partition's streams (its priority levels), read together.
        self._partitions = list(by_partition.values())
        count = share(state.capacity, len(self._partitions))
        #: the blocking reads of each partition, on the reader's own connections.
        self._reads = Wire(reader)
        self._read_commands = [
            (
                *("XREADGROUP", "GROUP", keys.WORKER_GROUP, consumer),
                *("COUNT", count, "BLOCK", block_ms, "STREAMS"),
                *streams,
                *[">"] * len(streams),
            )
            for streams in self._partitions
        ]

    async def ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
            except aioredis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def join_groups(self) -> bool:
        """Create the consumer groups, retrying while Redis is away; False if stopped first."""
        backoff = Backoff(UNREACHABLE_RETRY_DELAYS_S)
        while not self.state.stopping:
            try:
                await self.ensure_groups()
                return True
            except CONNECTION_ERRORS as exc:
                delay_s = backoff.next_s()
                log.warning("%s: Redis unreachable (%s); retry in %.2fs", self.name, exc, delay_s)
                await asyncio.sleep(delay_s)
        return False

    async def run(self) -> None:
        async with asyncio.TaskGroup() as loops:
            for command in self._read_commands:
                loops.create_task(self._read_loop(command))

    async def _read_loop(self, command: tuple[object, ...]) -> None:
        backoff = Backoff(UNREACHABLE_RETRY_DELAYS_S)
        while not self.state.stopping:
            await self.state.room.wait()
            if self.state.stopping:
                break
            try:
                reply = await self._reads.call(*command)
                backoff.reset()
            except aioredis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("%s: consumer group gone (Redis lost its data?)", self.name)
                if not await self.join_groups():
                    break
                continue
            except CONNECTION_ERRORS as exc:
                delay_s = backoff.next_s()
                log.warning("%s: read failed (%s); retry in %.2fs", self.name, exc, delay_s)
                await asyncio.sleep(delay_s)
                continue
            await self._admit(reply)
            # let the batch loop hand what was just read to an instance before this loop's
            # next read, whose Python would otherwise delay the batch's start
            await asyncio.sleep(0)

    async def catch_up(self, count: int) -> None:
        """Read what queued up while every instance was busy (see `QueueState.catch_up_count`):
        each partition its share."""
        count = share(count, len(self._partitions))
        for streams in self._partitions:
            try:
                reply = await self._reads.call(
                    *("XREADGROUP", "GROUP", keys.WORKER_GROUP, self.consumer, "COUNT", count),
                    *("STREAMS", *streams, *[">"] * len(streams)),
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
