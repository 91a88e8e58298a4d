"""Forming one model's batches: judge what is in hand, launch a batch or sleep until due.

The decision is `QueueState.decide` (the pure `next_batch`, after Triton's GetDynamicBatch); this
loop does the waiting: exactly as long as it says, or until the next request times out, or until a
request arrives or a lane frees. While every lane is busy, it has the inputs of a full next batch
made ahead (`sluice.workers.devices.stage_ahead`, on a GPU); while no request joins the batches that
wait, a lone batch runs as its delay runs out (`sluice.workers.batching.early_run`). Neither changes
a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from sluice.workers.batching.answering import Answering
from sluice.workers.batching.batcher import Send
from sluice.workers.batching.early_run import EarlyRuns
from sluice.workers.batching.queue_state import QueueState
from sluice.workers.batching.reader import StreamReader
from sluice.workers.instances.lanes import Instances


class BatchLoop:
    """Launches one model's batches until it is stopping and nothing is left in hand."""

    def __init__(
        self,
        state: QueueState,
        instances: Instances,
        reader: StreamReader,
        answering: Answering,
        early: EarlyRuns,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        """`clock`: wall time in ns, on which requests' enqueue times and delays count."""
        self.state = state
        self.instances = instances
        self.reader = reader
        self.answering = answering
        self.early = early
        self.clock_ns = clock_ns

    async def run(self) -> None:
        state = self.state
        while not state.finished:
            if not state.may_launch:
                if self.instances.ahead is not None and state.pending:
                    self._stage_next()
                state.wake.clear()
                await state.wake.wait()
                continue
            count = state.catch_up_count()
            if count:
                await self.reader.catch_up(count)
            now_ns = self.clock_ns()
            await self.answering.expire(state.expired(now_ns))
            if not state.pending:
                continue
            decision = state.decide(now_ns)
            if isinstance(decision, Send):
                launch = state.batch_launched(decision.indices, self.instances.last_run_ns)
                self.answering.start(launch, *self.early.claim(launch.batch))
                continue
            self.early.waiting()
            state.wake.clear()
            with contextlib.suppress(TimeoutError):
                wait_s = decision.ns / 1e9 if decision.ns else None
                await asyncio.wait_for(state.wake.wait(), wait_s)

    def _stage_next(self) -> None:
        """Every lane is busy: make the inputs of the full batch a free lane would take now."""
        assert self.instances.ahead is not None
        batch = self.state.full_batch(self.clock_ns())
        if batch:
            self.instances.ahead.stage([q.request for q in batch])
