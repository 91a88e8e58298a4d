"""One model's queue inside a worker: read from its stream, batch, run, publish, ack.

The reader pulls only while an instance is free and the pending requests do not fill a
batch, so a worker never hoards work other workers could do. The batcher asks
`next_batch` what to do and sleeps exactly as long as it says, or until a request arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import torch
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import keys
from shared.errors import InvalidInput, ModelExecutionError, SluiceError
from shared.model_config import ModelSpec
from shared.protocol import ProtocolError, Request, Result, decode_requests, encode_results
from shared.signature import Signature, validate_inputs
from shared.stats import FINISH_BATCH_LUA, BatchStats
from workers.batcher import BatchRules, Pending, Send, next_batch
from workers.execution import run_batch
from workers.models import Infer
from workers.recovery import STALE_CONSUMER_PERIODS, Claimed, Recovery, RecoveryPolicy

log = logging.getLogger(__name__)

#: safety cap on a gateway's reply stream, should that gateway stop trimming it.
REPLY_STREAM_MAXLEN = 10_000
RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


@dataclass(slots=True)
class Queued:
    request: Request
    entry_id: bytes
    pending: Pending


@dataclass(slots=True)
class QueueState:
    """Everything that changes while the queue runs, in one place."""

    pending: list[Queued] = field(default_factory=list)
    #: stream entry id -> requests of that entry not yet answered (ack when it reaches 0).
    unanswered: dict[bytes, int] = field(default_factory=dict)
    free_lanes: list[int] = field(default_factory=list)
    batches_done: int = 0
    stopping: bool = False


def batch_rules(spec: ModelSpec) -> BatchRules:
    policy = spec.batching
    return BatchRules(
        max_batch_size=spec.max_batch_size,
        dynamic=policy.dynamic,
        max_queue_delay_ns=policy.max_queue_delay_us * 1000,
        preferred_batch_sizes=frozenset(policy.preferred_batch_sizes),
    )


class ModelQueue:
    """Serves one model's stream with `len(lanes)` concurrent instances per version."""

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
    ) -> None:
        self.spec = spec
        self.signature = Signature.from_config(spec.config_json)
        self.rules = batch_rules(spec)
        self.instances = instances
        self.default_version = max(instances)
        self.device = device
        self.redis = redis
        self.reader = reader
        self.consumer = consumer
        self.block_ms = block_ms
        self.stream = keys.request_stream(spec.name)
        self.stats_key = keys.model_stats(spec.name)
        self.state = QueueState(free_lanes=list(range(spec.instance_count)))
        self._finish = redis.register_script(FINISH_BATCH_LUA)
        self.recovery = Recovery(redis, spec.name, consumer, recovery or RecoveryPolicy())
        self._pool = ThreadPoolExecutor(spec.instance_count, thread_name_prefix=f"{spec.name}")
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._running: set[asyncio.Task[None]] = set()

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, keys.WORKER_GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def stop(self) -> None:
        """Stop reading; requests already read are still run and answered."""
        self.state.stopping = True
        self._wake.set()
        self._room.set()

    async def run(self) -> None:
        for attempt in itertools.count():
            try:
                await self.ensure_group()
                break
            except (RedisConnectionError, RedisTimeoutError) as exc:
                delay = RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)]
                log.warning(
                    "%s: Redis unreachable (%s); retrying in %.2fs", self.spec.name, exc, delay
                )
                await asyncio.sleep(delay)
        reader = asyncio.create_task(self._read_loop(), name=f"read:{self.spec.name}")
        recovery = asyncio.create_task(self._recovery_loop(), name=f"recover:{self.spec.name}")
        try:
            await self._batch_loop()
        finally:
            reader.cancel()
            recovery.cancel()
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)
            self._pool.shutdown(wait=True)

    # -- reading -----------------------------------------------------------------------

    async def _read_loop(self) -> None:
        attempt = 0
        while not self.state.stopping:
            await self._room.wait()
            if self.state.stopping:
                break
            try:
                reply = await self.reader.xreadgroup(
                    keys.WORKER_GROUP,
                    self.consumer,
                    {self.stream: ">"},
                    count=max(1, self.spec.max_batch_size),
                    block=self.block_ms,
                )
                attempt = 0
            except aioredis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning(
                    "%s: consumer group gone (Redis lost its data?); recreating", self.spec.name
                )
                await self.ensure_group()
                continue
            except (RedisConnectionError, RedisTimeoutError) as exc:
                delay = RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)]
                log.warning(
                    "%s: reading failed (%s); retrying in %.2fs", self.spec.name, exc, delay
                )
                attempt += 1
                await asyncio.sleep(delay)
                continue
            now = time.time_ns()
            rejected: list[tuple[Queued, Result]] = []
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    rejected += self._admit(entry_id, fields, now)
            if rejected:
                await self._publish([q for q, _ in rejected], [r for _, r in rejected], None)
            self._update_room()
            self._wake.set()

    def _admit(
        self, entry_id: bytes, fields: dict[bytes, bytes], now: int
    ) -> list[tuple[Queued, Result]]:
        """Queue an entry's requests; return the ones rejected, with their error results."""
        try:
            requests = decode_requests(fields)
        except ProtocolError as exc:
            log.error("%s: dropping undecodable entry %r: %s", self.spec.name, entry_id, exc)
            self._spawn(self._publish([], [], None, extra_acks=[entry_id]))
            return []
        return self._queue(entry_id, requests, now, alone=False)

    def _queue(
        self, entry_id: bytes, requests: Sequence[Request], now: int, alone: bool
    ) -> list[tuple[Queued, Result]]:
        self.state.unanswered[entry_id] = len(requests)
        rejected = []
        for request in requests:
            queued = Queued(request, entry_id, Pending(None, 1, min(request.enqueue_ns, now)))
            try:
                queued.pending = self._pending(request, queued.pending.start_ns, alone)
            except SluiceError as exc:
                rejected.append((queued, Result(request.id, error=(exc.code, exc.message))))
                continue
            self.state.pending.append(queued)
        return rejected

    def _pending(self, request: Request, start_ns: int, alone: bool) -> Pending:
        if request.version == 0:
            request.version = self.default_version
        elif request.version not in self.instances:
            raise InvalidInput(
                f"model '{self.spec.name}' version {request.version} is not served here"
            )
        size = validate_inputs(self.signature, request.inputs)
        batched = self.spec.max_batch_size > 0
        shapes = tuple(
            (t.name, t.shape[1:] if batched else t.shape)
            for t in sorted(request.inputs, key=lambda t: t.name)
        )
        group = ("alone", request.id) if alone else (request.version, shapes)
        return Pending(group, size, start_ns)

    def _update_room(self) -> None:
        queued = sum(q.pending.batch_size for q in self.state.pending)
        if self.state.free_lanes and queued < max(1, self.spec.max_batch_size):
            self._room.set()
        else:
            self._room.clear()

    # -- batching ----------------------------------------------------------------------

    async def _batch_loop(self) -> None:
        state = self.state
        while True:
            if state.stopping and not state.pending:
                return
            if not state.free_lanes or not state.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = time.time_ns()
            decision = next_batch([q.pending for q in state.pending], now, self.rules)
            if isinstance(decision, Send) or state.stopping:
                indices = decision.indices if isinstance(decision, Send) else (0,)
                chosen = set(indices)
                batch = [state.pending[i] for i in indices]
                state.pending = [q for i, q in enumerate(state.pending) if i not in chosen]
                lane = state.free_lanes.pop()
                self._spawn(self._execute(lane, batch))
                self._update_room()
                continue
            self._wake.clear()
            timeout_s = decision.ns / 1e9 if decision.ns else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=timeout_s)

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _execute(self, lane: int, batch: list[Queued]) -> None:
        requests = [q.request for q in batch]
        started = time.time_ns()
        stats = BatchStats(
            requests[0].version, sum(q.pending.batch_size for q in batch), started // 1_000_000
        )
        stats.queue_ns = sum(max(0, started - r.enqueue_ns) for r in requests)
        results = await self._run_isolating(lane, batch, stats)
        failed = sum(r.error is not None for r in results)
        stats.requests_ok, stats.requests_failed = len(results) - failed, failed
        finished = time.time_ns()
        stats.request_ns = sum(max(0, finished - r.enqueue_ns) for r in requests)
        await self._publish(batch, results, stats)
        self.state.batches_done += 1
        self.state.free_lanes.append(lane)
        self._update_room()
        self._wake.set()

    async def _run_isolating(
        self, lane: int, batch: Sequence[Queued], stats: BatchStats
    ) -> list[Result]:
        """Run a batch; if the model raises, re-run the halves so only the culprit fails."""
        requests = [q.request for q in batch]
        sizes = [q.pending.batch_size for q in batch]
        infer = self.instances[requests[0].version][lane]
        try:
            outputs, timing = await asyncio.get_running_loop().run_in_executor(
                self._pool, run_batch, self.spec, infer, requests, sizes, self.device
            )
        except Exception as exc:  # the model's own failure, reported to its request
            if len(batch) > 1:
                middle = len(batch) // 2
                return [
                    *await self._run_isolating(lane, batch[:middle], stats),
                    *await self._run_isolating(lane, batch[middle:], stats),
                ]
            error = (
                exc
                if isinstance(exc, ModelExecutionError)
                else ModelExecutionError(f"model '{self.spec.name}' failed: {exc}")
            )
            log.warning("%s: request %s failed: %s", self.spec.name, requests[0].id, exc)
            return [Result(requests[0].id, error=(error.code, error.message))]
        stats.input_ns += timing.input_ns
        stats.infer_ns += timing.infer_ns
        stats.output_ns += timing.output_ns
        return [Result(r.id, outs) for r, outs in zip(requests, outputs, strict=True)]

    # -- recovery ----------------------------------------------------------------------

    async def _recovery_loop(self) -> None:
        rounds = 0
        while not self.state.stopping:
            await asyncio.sleep(self.recovery.interval_s)
            try:
                await self.recovery.keep_alive(list(self.state.unanswered))
                if self._room.is_set() and not self.state.stopping:
                    await self._take_over(
                        await self.recovery.claim(max(1, self.spec.max_batch_size))
                    )
                rounds += 1
                if rounds % STALE_CONSUMER_PERIODS == 0:
                    await self.recovery.prune_consumers()
            except RedisError as exc:
                log.warning("%s: recovery round failed: %s", self.spec.name, exc)

    async def _take_over(self, claimed: list[Claimed]) -> None:
        now = time.time_ns()
        rejected: list[tuple[Queued, Result]] = []
        for item in claimed:
            if item.entry_id in self.state.unanswered:
                continue
            try:
                requests = decode_requests(item.fields) if item.fields else []
            except ProtocolError as exc:
                await self.recovery.dead_letter(item, f"undecodable: {exc}")
                requests = []
            if not requests:
                await self._publish([], [], None, extra_acks=[item.entry_id])
            elif len(requests) > 1:
                await self.recovery.split(item.entry_id, requests)
            elif self.recovery.too_often(item):
                reason = (
                    f"request {requests[0].id} was delivered {item.deliveries} times and its "
                    f"worker died each time; moved to dead-letter stream "
                    f"{self.recovery.dead_stream}"
                )
                await self.recovery.dead_letter(item, reason)
                self.state.unanswered[item.entry_id] = 1
                queued = Queued(requests[0], item.entry_id, Pending(None, 1, now))
                rejected.append((queued, Result(requests[0].id, error=("INTERNAL", reason))))
            else:
                rejected += self._queue(item.entry_id, requests, now, alone=True)
        if rejected:
            await self._publish([q for q, _ in rejected], [r for _, r in rejected], None)
        self._update_room()
        self._wake.set()

    # -- answering ---------------------------------------------------------------------

    async def _publish(
        self,
        batch: Sequence[Queued],
        results: Sequence[Result],
        stats: BatchStats | None,
        extra_acks: Sequence[bytes] = (),
    ) -> None:
        """Reply to each gateway, then ack and delete the fully answered entries."""
        by_route: dict[str, list[Result]] = defaultdict(list)
        for queued, result in zip(batch, results, strict=True):
            by_route[queued.request.reply_to].append(result)
        done = list(extra_acks)
        for queued in batch:
            left = self.state.unanswered[queued.entry_id] - 1
            if left:
                self.state.unanswered[queued.entry_id] = left
            else:
                del self.state.unanswered[queued.entry_id]
                done.append(queued.entry_id)
        for entry_id in extra_acks:
            self.state.unanswered.pop(entry_id, None)
        args: list[str | int | bytes] = [keys.WORKER_GROUP, len(done), *done]
        if stats is not None:
            args += stats.increments()
        for attempt, delay in enumerate((*RETRY_DELAYS_S, None)):
            pipe = self.redis.pipeline(transaction=False)
            for route, route_results in by_route.items():
                pipe.xadd(
                    route,
                    encode_results(route_results),
                    maxlen=REPLY_STREAM_MAXLEN,
                    approximate=True,
                )
            await self._finish(keys=[self.stream, self.stats_key], args=args, client=pipe)
            try:
                await pipe.execute()
                return
            except (RedisConnectionError, RedisTimeoutError) as exc:
                if delay is None:
                    log.error(
                        "%s: could not publish %d results: %s", self.spec.name, len(results), exc
                    )
                    return
                log.warning("%s: publish failed (attempt %d): %s", self.spec.name, attempt + 1, exc)
                await asyncio.sleep(delay)
