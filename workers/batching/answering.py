"""Answering one model's requests: a batch's run is awaited, its results published and acked.

Every answer goes out on a task of its own, so the batch loop never waits for Redis. Under
load a lane is freed as soon as its run ends, before its answers are encoded and written, so
the next batch's run overlaps them. A batch run on the loop's own thread had nothing else in
hand: it is answered, its statistics with it, before the reader's next read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.shared.errors import SluiceError, error_from_code
from sluice.shared.idle_poll import IdlePoll
from sluice.shared.protocol import Request, Result
from sluice.shared.stats import BatchStats, failure_increments
from sluice.workers.answers.publisher import Publisher
from sluice.workers.answers.streamed import ResponseStream
from sluice.workers.batching.early_run import Early
from sluice.workers.batching.pending import Queued
from sluice.workers.batching.queue_state import Launch, QueueState
from sluice.workers.batching.trace_spans import TracedRequest, WorkerSpans
from sluice.workers.instances.lanes import Instances
from sluice.workers.instances.model_instance import BatchOutputs


class Answering:
    """Publishes one model queue's results; owns the tasks that do it."""

    def __init__(
        self,
        publisher: Publisher,
        instances: Instances,
        state: QueueState,
        idle_poll: IdlePoll,
        responses: ResponseStream | None = None,
    ) -> None:
        self.publisher = publisher
        self.instances = instances
        self.state = state
        self.idle_poll = idle_poll
        #: a decoupled model's: its requests are answered through it, not by their batch.
        self.responses = responses
        self._tasks: set[asyncio.Future[None]] = set()
        #: answers are written in the order their batches started (a sequence model's, whose
        #: next step may start before its last step's answer is written).
        self.in_order = False
        self._last_turn: asyncio.Future[None] | None = None
        #: sees a batch's results before they are published (the sequence loop's: it keeps the
        #: implicit state a model returned, which is never the client's).
        self.results_hook: Callable[[list[Result]], Awaitable[None]] | None = None
        #: OpenTelemetry mode: the spans of the traced requests answered here.
        self.spans: WorkerSpans | None = None

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for every answer still being written (failures are the tasks' own)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def drop_cancelled(self, item: Queued) -> None:
        error = ("CANCELLED", "Request was cancelled: the client disconnected")
        await self.publisher.publish(
            [item],
            [Result(item.request.id, error=error)],
            failure_increments(item.request.version, "CANCELED", 1),
        )

    async def reject(self, rejected: Sequence[tuple[Queued, Result]]) -> None:
        if rejected:
            await self.publisher.publish([q for q, _ in rejected], [r for _, r in rejected])

    async def expire(self, expired: Sequence[tuple[Queued, SluiceError, str]]) -> None:
        for item, error, reason in expired:
            result = Result(item.request.id, error=(error.code, error.message))
            await self.publisher.publish(
                [item], [result], failure_increments(item.request.version, reason, 1)
            )

    def _streamed(
        self, batch: Sequence[Queued], results: list[Result]
    ) -> tuple[list[Queued], list[Result]]:
        """A decoupled model's run: its requests answer through their response streams. Those
        it failed as a whole (its execute raised) and that are still open get the error as
        their final response; nothing else is published with the batch's statistics."""
        assert self.responses is not None
        for item, result in zip(batch, results, strict=True):
            if result.error is not None:
                self.responses.end(item.request, error_from_code(*result.error))
        return [], []

    def start(
        self,
        launch: Launch,
        early: Early | None = None,
        dropped: bool = False,
        ran: Callable[[], None] | None = None,
    ) -> None:
        """Start the batch on its lane's thread within the batch loop's turn (or run it right
        here when `launch.inline`), and answer it on a task of its own. A batch that ran
        `early` is answered by that run instead; `dropped`: a run made early for other
        requests was dropped when this batch was formed (both counted in its statistics).
        `ran` is called once its results were taken (the model ran, or failed), before they
        are written; with `in_order`, answers are written in the order their batches
        started."""
        requests = [q.request for q in launch.batch]
        sizes = [q.pending.batch_size for q in launch.batch]
        if self.responses is not None:
            self.responses.open(launch.batch)
        if early is not None:
            started_ns, running = early.started_ns, early.running
        else:
            started_ns = time.time_ns()
            running = self.instances.start(launch.lane, requests, sizes, here=launch.inline)
        stats = BatchStats(requests[0].version, sum(sizes), started_ns // 1_000_000)
        stats.started_ns = started_ns
        stats.queue_samples_ns = [
            max(0, started_ns - q.request.enqueue_ns) for q in launch.batch if not q.filler
        ]
        stats.early_answered, stats.early_dropped = early is not None, dropped
        stats.null_rows = sum(q.pending.batch_size for q in launch.batch if q.filler)
        turn = self._next_turn() if self.in_order else None
        once = _Once(ran)
        traced = self.spans.opened(launch.batch) if self.spans is not None else None
        answer = self._answer(launch, requests, sizes, stats, running, once, turn, traced)
        # an ordinary model's batch needs neither callback nor turn: no wrapper on its path
        self.spawn(answer if ran is None and turn is None else _then(answer, once, turn))

    def _next_turn(self) -> _Turn:
        turn = _Turn(self._last_turn, asyncio.get_running_loop().create_future())
        self._last_turn = turn.done
        return turn

    async def _answer(
        self,
        launch: Launch,
        requests: list[Request],
        sizes: list[int],
        stats: BatchStats,
        running: asyncio.Future[BatchOutputs],
        ran: _Once,
        turn: _Turn | None,
        traced: list[TracedRequest] | None = None,
    ) -> None:
        lane, inline = launch.lane, launch.inline
        results = await self.instances.run_isolating(lane, requests, sizes, stats, running)
        ran_ns = time.time_ns() if traced else 0
        if any(r.traced for r in requests):
            _stamp(requests, results, stats.compute_timestamps())
        items: Sequence[Queued] = launch.batch
        if any(q.filler for q in items):  # the null requests' answers are dropped
            kept = [i for i, q in enumerate(items) if not q.filler]
            items, results = [items[i] for i in kept], [results[i] for i in kept]
            requests = [requests[i] for i in kept]
        if self.results_hook is not None:
            await self.results_hook(results)
        ran()
        # a model's own error answer counts as a success, as Triton's statistics count it
        failed = [r.error is not None and not r.answered_by_model for r in results]
        stats.settle([r.enqueue_ns for r in requests], failed, time.time_ns())
        if not inline:
            # the instance is free now: let the batch loop start the next batch before this
            # one's answers are encoded and written, which then overlap the next run
            self.state.batch_finished(lane)
            await asyncio.sleep(0)
        # statistics are summed over a short while when more work is in hand
        in_hand = not inline and self.state.in_hand
        if self.responses is not None:
            items, results = self._streamed(launch.batch, results)
        if turn is not None and turn.previous is not None:
            await turn.previous  # the answers of the batch started before go first
        try:
            await self.publisher.publish(
                items, results, stats.increments(), defer_statistics=in_hand
            )
        finally:
            if inline:
                self.state.inline_answered(lane)
                self.idle_poll.arm()
            if turn is not None:  # the loop writes held statistics once nothing runs
                self.state.wake.set()
        self.state.results_published()
        if traced:
            assert self.spans is not None
            members = [q.request for q in launch.batch if not q.filler]
            compute = stats.compute_timestamps()
            self.spans.answered(traced, members, sum(sizes), compute, ran_ns, time.time_ns())


class _Once:
    """Calls `callback` (if any) the first time it is called."""

    def __init__(self, callback: Callable[[], None] | None) -> None:
        self.callback = callback

    def __call__(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


@dataclass(slots=True)
class _Turn:
    """A batch's place in the order its answers are written: the batch before's is done."""

    previous: asyncio.Future[None] | None
    done: asyncio.Future[None]


async def _then(answer: Coroutine[Any, Any, None], ran: _Once, turn: _Turn | None) -> None:
    """Answer the batch; however that ends, `ran` has been called and its turn is over."""
    try:
        await answer
    finally:
        ran()
        if turn is not None and not turn.done.done():
            turn.done.set_result(None)


def _stamp(requests: Sequence[Request], results: Sequence[Result], stamps: list[int]) -> None:
    """A traced request's result carries its batch's compute timestamps to its gateway."""
    for request, result in zip(requests, results, strict=True):
        if request.traced:
            result.timestamps = stamps
