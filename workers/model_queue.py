"""One model's queue inside a worker: read from its streams, batch, run, publish, ack.

The reader keeps one batch in hand: it pulls while the pending requests do not fill a batch,
also while every instance is busy, so the next batch is ready the moment an instance frees
(no read round trip between batches), and a worker never holds more than one batch that
other workers could run. A model with priority levels reads only while an instance is free,
then once more just before each batch, so that a request of a higher level arriving
meanwhile is never stuck behind a batch of lower ones already in hand. The batcher asks
`next_batch` what to do and sleeps exactly as long as it says (or until the next request
times out), or until a request arrives. When the model has nothing else to do (one instance,
requests further apart than a run), a batch runs on the loop's own thread and is answered
before the next read (`runs_inline`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import redis.asyncio as aioredis
import torch
from sluice.shared import keys
from sluice.shared.errors import InvalidInput, SluiceError
from sluice.shared.idle_poll import DEFAULT_WINDOW_US, IdlePoll
from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import ProtocolError, Request, Result, decode_requests
from sluice.shared.queue_policy import QueuePolicy, deadline_us
from sluice.shared.redis_client import CONNECTION_ERRORS, REDIS_ERRORS
from sluice.shared.redis_wire import Wire, stream_entries
from sluice.shared.signature import Signature, validate_inputs
from sluice.shared.stats import BatchStats, failure_increments
from sluice.workers.batcher import (
    INLINE_RUN_LIMIT_NS,
    ArrivalGap,
    BatchRules,
    Pending,
    Send,
    next_batch,
    runs_inline,
)
from sluice.workers.execution import BatchOutputs
from sluice.workers.instances import Instances
from sluice.workers.models import Infer
from sluice.workers.pending import PendingQueue, Queued
from sluice.workers.publisher import RETRY_DELAYS_S, Publisher
from sluice.workers.recovery import STALE_CONSUMER_PERIODS, Claimed, Recovery, RecoveryPolicy

log = logging.getLogger(__name__)

#: how many cancelled-but-unread request ids a worker remembers.
CANCELLED_MEMORY = 10_000


def batch_rules(spec: ModelSpec, default_delay_mode: str = "fixed") -> BatchRules:
    """The model's rules; its own BATCH_DELAY wins over the server's `default_delay_mode`."""
    policy = spec.batching
    return BatchRules(
        max_batch_size=spec.max_batch_size,
        dynamic=policy.dynamic,
        max_queue_delay_ns=policy.max_queue_delay_us * 1000,
        preferred_batch_sizes=frozenset(policy.preferred_batch_sizes),
        adaptive_delay=(policy.delay_mode or default_delay_mode) == "adaptive",
    )


class ModelQueue:
    """Serves one model's streams with `instance_count` concurrent instances per version."""

    def __init__(
        self,
        spec: ModelSpec,
        instances: dict[int, list[Infer]],
        device: torch.device,
        redis: aioredis.Redis,
        reader: aioredis.Redis,
        consumer: str,
        block_ms: int = 1000,
        recovery: RecoveryPolicy | None = None,
        idle_poll_us: int = DEFAULT_WINDOW_US,
        default_delay_mode: str = "fixed",
    ) -> None:
        self.spec = spec
        self.signature = Signature.from_config(spec.config_json)
        self.rules = batch_rules(spec, default_delay_mode)
        #: gaps beyond twice the delay say no more about whether waiting would pay.
        self.arrivals = ArrivalGap(cap_ns=2 * self.rules.max_queue_delay_ns)
        #: the same gaps, capped far enough above a short run to compare with it.
        self.spacing = ArrivalGap(cap_ns=2 * INLINE_RUN_LIMIT_NS)
        self.policy = QueuePolicy.from_config(spec.config_json)
        self.instances = Instances(spec, instances, device)
        self.redis = redis
        self.reader = reader
        self.consumer = consumer
        self.block_ms = block_ms
        self.streams = {keys.request_stream(spec.name, lv): lv for lv in self.policy.levels}
        #: the blocking read of the streams, on the reader's own connection.
        self._reads = Wire(reader)
        self._read_command = (
            *("XREADGROUP", "GROUP", keys.WORKER_GROUP, consumer),
            *("COUNT", max(1, spec.max_batch_size), "BLOCK", block_ms, "STREAMS"),
            *self.streams,
            *[">"] * len(self.streams),
        )
        counted = {lv for lv in self.policy.levels if self.policy.for_level(lv).max_queue_size}
        self.publisher = Publisher(redis, spec.name, counted)
        recovery = recovery or RecoveryPolicy()
        self.recoveries = [Recovery(redis, spec.name, s, consumer, recovery) for s in self.streams]
        self.pending = PendingQueue()
        self.free_lanes = list(range(spec.instance_count))
        self.batches_done = 0
        self.stopping = False
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._running: set[asyncio.Future[None]] = set()
        #: keep a batch in hand while the instances are busy (FIFO models; see the docstring).
        self._read_ahead = len(self.streams) == 1
        #: a batch just finished and nothing was read ahead: read what queued up meanwhile.
        self._catch_up = False
        #: a batch run on the loop is being answered: the reader waits until it is.
        self._answering_inline = False
        #: ids cancelled before this worker read them (insertion-ordered, bounded).
        self._cancelled: dict[str, None] = {}
        #: after a batch run on the loop (lone requests), poll for the next one
        self.idle_poll = IdlePoll(
            idle_poll_us * 1000,
            lambda: not self.pending and len(self.free_lanes) == spec.instance_count,
        )

    async def ensure_groups(self) -> None:
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
            except aioredis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def stop(self) -> None:
        """Stop reading; requests already read are still run and answered."""
        self.stopping = True
        self._wake.set()
        self._room.set()

    def cancel(self, request_id: str) -> None:
        """Its client went away: drop the request if it has not started, or when it is read."""
        item = self.pending.cancel(request_id)
        if item is None:
            self._cancelled[request_id] = None
            if len(self._cancelled) > CANCELLED_MEMORY:
                del self._cancelled[next(iter(self._cancelled))]
            return
        self._spawn(self._drop_cancelled(item))
        self._update_room()

    async def _drop_cancelled(self, item: Queued) -> None:
        error = ("CANCELLED", "Request was cancelled: the client disconnected")
        await self.publisher.publish(
            [item],
            [Result(item.request.id, error=error)],
            failure_increments(item.request.version, "CANCELED", 1),
        )

    async def _join_groups(self) -> bool:
        """Create the consumer groups, retrying while Redis is away; False if stopped first."""
        for attempt in itertools.count():
            if self.stopping:
                return False
            try:
                await self.ensure_groups()
                return True
            except CONNECTION_ERRORS as exc:
                delay = RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)]
                log.warning(
                    "%s: Redis unreachable (%s); retry in %.2fs", self.spec.name, exc, delay
                )
                await asyncio.sleep(delay)
        return False

    async def run(self) -> None:
        if not await self._join_groups():
            self.instances.shutdown()
            return
        helpers = [
            asyncio.create_task(self._read_loop(), name=f"read:{self.spec.name}"),
            asyncio.create_task(self._recovery_loop(), name=f"recover:{self.spec.name}"),
        ]
        try:
            await self._batch_loop()
        finally:
            for task in helpers:
                task.cancel()
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)
            self.idle_poll.stop()
            self.instances.shutdown()
            await self._reads.close()
            await self.publisher.close()

    # -- reading -----------------------------------------------------------------------

    async def _read_loop(self) -> None:
        attempt = 0
        while not self.stopping:
            await self._room.wait()
            if self.stopping:
                break
            try:
                reply = await self._reads.call(*self._read_command)
                attempt = 0
            except aioredis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("%s: consumer group gone (Redis lost its data?)", self.spec.name)
                if not await self._join_groups():
                    break
                continue
            except CONNECTION_ERRORS as exc:
                delay = RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)]
                log.warning("%s: read failed (%s); retry in %.2fs", self.spec.name, exc, delay)
                attempt += 1
                await asyncio.sleep(delay)
                continue
            await self._admit_reply(reply)
            # let the batch loop hand what was just read to an instance before this loop's
            # next read, whose Python would otherwise delay the batch's start
            await asyncio.sleep(0)

    async def _admit_reply(self, reply: Any) -> None:
        now = time.time_ns()
        rejected: list[tuple[Queued, Result]] = []
        for raw_stream, entries in stream_entries(reply):
            stream = raw_stream.decode() if isinstance(raw_stream, bytes) else raw_stream
            for entry_id, fields in entries:
                rejected += self._admit(stream, entry_id, fields, now)
        await self._reject(rejected)
        self._update_room()
        self._wake.set()

    def _admit(
        self, stream: str, entry_id: bytes, fields: dict[bytes, bytes], now: int
    ) -> list[tuple[Queued, Result]]:
        """Queue an entry's requests; return the ones rejected, with their error results."""
        try:
            requests = decode_requests(fields)
        except ProtocolError as exc:
            log.error("%s: dropping undecodable entry %r: %s", self.spec.name, entry_id, exc)
            self._spawn(self.publisher.publish([], [], extra_acks=[(stream, entry_id)]))
            return []
        return self._queue(stream, entry_id, requests, now, alone=False)

    def _queue(
        self, stream: str, entry_id: bytes, requests: Sequence[Request], now: int, alone: bool
    ) -> list[tuple[Queued, Result]]:
        self.publisher.hold(stream, entry_id, len(requests))
        level = self.streams[stream]
        rejected = []
        for request in requests:
            item = Queued(request, stream, entry_id, Pending(None, 1, 0), level, next(self._seq))
            if request.id in self._cancelled:
                del self._cancelled[request.id]
                self._spawn(self._drop_cancelled(item))
                continue
            try:
                self._prepare(item, now, alone)
            except SluiceError as exc:
                rejected.append((item, Result(request.id, error=(exc.code, exc.message))))
                continue
            self.pending.add(item)
        return rejected

    def _prepare(self, item: Queued, now: int, alone: bool) -> None:
        """Validate the request and work out its batch group, size and deadlines."""
        request = item.request
        if request.version == 0:
            request.version = self.instances.default_version
        elif request.version not in self.instances.by_version:
            raise InvalidInput(f"model '{self.spec.name}' version {request.version} not served")
        size = validate_inputs(self.signature, request.inputs)
        batched = self.spec.max_batch_size > 0
        shapes = tuple(
            (t.name, t.shape[1:] if batched else t.shape)
            for t in sorted(request.inputs, key=lambda t: t.name)
        )
        group = ("alone", request.id) if alone else (request.version, shapes)
        start = min(request.enqueue_ns, now)
        if not alone:
            self.arrivals.observe(start)
            self.spacing.observe(start)
        item.pending = Pending(group, size, start)
        timeout_us = self.policy.queue_timeout_us(item.level, request.parameters)
        if timeout_us:
            item.timeout_at_ns = start + timeout_us * 1000
            item.reject_on_timeout = self.policy.for_level(item.level).timeout_action != "DELAY"
        limit_us = deadline_us(request.parameters)
        if limit_us:
            item.deadline_at_ns = start + limit_us * 1000

    async def _reject(self, rejected: Sequence[tuple[Queued, Result]]) -> None:
        if rejected:
            await self.publisher.publish([q for q, _ in rejected], [r for _, r in rejected])

    def _update_room(self) -> None:
        may_read = (bool(self.free_lanes) or self._read_ahead) and not self._answering_inline
        if may_read and self.pending.units() < max(1, self.spec.max_batch_size):
            self._room.set()
        else:
            self._room.clear()

    # -- batching ----------------------------------------------------------------------

    async def _batch_loop(self) -> None:
        while True:
            if self.stopping and not self.pending:
                return
            if not self.free_lanes or not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._catch_up:
                await self._read_available()
            now = time.time_ns()
            await self._expire(now)
            if not self.pending:
                continue
            decision = next_batch(self.pending.pendings(), now, self.rules, self.arrivals.mean_ns)
            if isinstance(decision, Send) or self.stopping:
                indices = decision.indices if isinstance(decision, Send) else (0,)
                self._launch(self.free_lanes.pop(), self.pending.take(indices))
                self._update_room()
                continue
            await self._sleep(now, decision.ns)

    async def _read_available(self) -> None:
        """After a batch, take what queued up meanwhile before judging the next one.

        The blocking reader may have handed over only the first request that arrived while
        every instance was busy; that one is already past its delay, so without this read
        it would run alone although others wait in the stream.
        """
        self._catch_up = False
        room = max(1, self.spec.max_batch_size) - self.pending.units()
        if self.stopping or not self.pending or room <= 0 or not self.rules.dynamic:
            return
        try:
            reply = await self.redis.xreadgroup(
                keys.WORKER_GROUP, self.consumer, dict.fromkeys(self.streams, ">"), count=room
            )
        except REDIS_ERRORS as exc:
            log.warning("%s: catch-up read failed: %s", self.spec.name, exc)
            return
        await self._admit_reply(reply)

    async def _sleep(self, now: int, wait_ns: int | None) -> None:
        expiry = self.pending.next_expiry_ns()
        if expiry is not None:
            wait_ns = max(0, expiry - now) if wait_ns is None else min(wait_ns, expiry - now)
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), wait_ns / 1e9 if wait_ns else None)

    async def _expire(self, now: int) -> None:
        for item, error, reason in self.pending.expire(now):
            result = Result(item.request.id, error=(error.code, error.message))
            await self.publisher.publish(
                [item], [result], failure_increments(item.request.version, reason, 1)
            )
        self._update_room()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _launch(self, lane: int, batch: list[Queued]) -> None:
        """Start the batch on its instance's thread now, within the batch loop's turn (or run
        it right here, see `runs_inline`)."""
        started = time.time_ns()
        inline = runs_inline(
            self.spec.instance_count,
            bool(self.pending),
            self.instances.last_run_ns,
            self.spacing.mean_ns,
        )
        if inline:
            self._answering_inline = True
            self._update_room()
        requests = [q.request for q in batch]
        sizes = [q.pending.batch_size for q in batch]
        running = self.instances.start(lane, requests, sizes, here=inline)
        self._spawn(self._execute(lane, batch, requests, sizes, started, running, inline))

    async def _execute(
        self,
        lane: int,
        batch: list[Queued],
        requests: list[Request],
        sizes: list[int],
        started: int,
        running: asyncio.Future[BatchOutputs],
        inline: bool,
    ) -> None:
        stats = BatchStats(requests[0].version, sum(sizes), started // 1_000_000)
        stats.queue_samples_ns = [max(0, started - r.enqueue_ns) for r in requests]
        results = await self.instances.run_isolating(lane, requests, sizes, stats, running)
        failed = sum(r.error is not None for r in results)
        stats.requests_ok, stats.requests_failed = len(results) - failed, failed
        finished = time.time_ns()
        stats.request_samples_ns = [max(0, finished - r.enqueue_ns) for r in requests]
        if not inline:
            # the instance is free now: let the batch loop start the next batch before this
            # one's answers are encoded and written, which then overlap the next run
            self._free(lane)
            await asyncio.sleep(0)
        # a batch run on the loop had nothing else in hand: its answer goes out before the
        # reader's next read, its statistics with it
        in_hand = not inline and (
            bool(self.pending) or len(self.free_lanes) < self.spec.instance_count
        )
        try:
            await self.publisher.publish(
                batch, results, stats.increments(), defer_statistics=in_hand
            )
        finally:
            if inline:
                self._answering_inline = False
                self._free(lane)
                self.idle_poll.arm()
        self.batches_done += 1

    def _free(self, lane: int) -> None:
        self.free_lanes.append(lane)
        self._catch_up = not self._read_ahead
        self._update_room()
        self._wake.set()

    # -- recovery ----------------------------------------------------------------------

    async def _recovery_loop(self) -> None:
        for rounds in itertools.count(1):
            await asyncio.sleep(self.recoveries[0].interval_s)
            if self.stopping:
                return
            try:
                for recovery in self.recoveries:
                    await recovery.keep_alive(self.publisher.held(recovery.stream))
                    if self._room.is_set():
                        count = max(1, self.spec.max_batch_size)
                        await self._take_over(recovery, await recovery.claim(count))
                    if rounds % STALE_CONSUMER_PERIODS == 0:
                        await recovery.prune_consumers()
            except REDIS_ERRORS as exc:
                log.warning("%s: recovery round failed: %s", self.spec.name, exc)

    async def _take_over(self, recovery: Recovery, claimed: list[Claimed]) -> None:
        now = time.time_ns()
        stream = recovery.stream
        rejected: list[tuple[Queued, Result]] = []
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
                queued = Queued(
                    requests[0], stream, item.entry_id, Pending(None, 1, now), self.streams[stream]
                )
                rejected.append((queued, Result(requests[0].id, error=("INTERNAL", reason))))
            else:
                rejected += self._queue(stream, item.entry_id, requests, now, alone=True)
        await self._reject(rejected)
        self._update_room()
        self._wake.set()
