"""A sequence model's queue loop: Triton's sequence batcher over the requests this worker owns.

The reader reads this worker's own sequence stream (shared/sequence_routing.py routes each
sequence's requests there) and the model's shared streams, whose requests go on to their
owners (owner_duties.py). Every request of ours goes to the `SequenceBatcher`, which keeps the
slots and says what each free instance runs next; before a batch runs, the server's inputs are
given (server_inputs.py: control inputs, implicit state, null requests); after it, each
sequence keeps its state (state_keeper.py) and may run its next request, while answers are
written in the order their batches started, so a sequence's leave in its order. A sequence
whose END ran leaves its slot; one idle past its `max_sequence_idle_microseconds` is released,
here and in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from functools import partial

from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import Result
from sluice.shared.redis_client import REDIS_ERRORS
from sluice.shared.sequence_controls import SEQUENCE_END, SEQUENCE_ID, SEQUENCE_START
from sluice.shared.sequence_routing import start_missing
from sluice.workers.batching.answering import Answering
from sluice.workers.batching.pending import Queued
from sluice.workers.batching.queue_state import Launch, QueueState
from sluice.workers.sequences.owner_duties import OwnerDuties
from sluice.workers.sequences.ownership import SequenceOwnership
from sluice.workers.sequences.rules import sequence_rules
from sluice.workers.sequences.sequence_batcher import Member, SequenceBatcher
from sluice.workers.sequences.server_inputs import ServerInputs
from sluice.workers.sequences.state_keeper import StateKeeper

log = logging.getLogger(__name__)

#: requests a worker queues for its sequences, per slot, before it stops reading its stream.
MAX_QUEUED_PER_SLOT = 8


class SequenceLoop:
    """Runs a sequence model's batches until the queue stops and nothing is left in hand."""

    def __init__(
        self,
        spec: ModelSpec,
        state: QueueState,
        answering: Answering,
        ownership: SequenceOwnership,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.spec = spec
        self.state = state
        self.answering = answering
        self.ownership = ownership
        self.batcher: SequenceBatcher[Queued] = SequenceBatcher(sequence_rules(spec))
        self.inputs = ServerInputs(spec)
        self.keeper = StateKeeper(spec, ownership, self.batcher)
        if self.inputs.states:
            answering.results_hook = self.keeper.keep
        answering.in_order = True
        self.duties = OwnerDuties(
            spec.name, ownership, self.batcher, answering, self.keeper.checkpointed
        )
        self.clock_ns = clock_ns
        #: requests queued for their sequences at most; past it the reader stops reading.
        rules = self.batcher.rules
        self.max_queued = MAX_QUEUED_PER_SLOT * rules.instances * rules.slots
        #: the batches running or being answered, by number.
        self._running: dict[int, list[Member[Queued]]] = {}
        self._batch_ids = itertools.count()
        #: the batches that ran (their state kept) since the loop last looked.
        self._done: list[int] = []
        #: we stop: our lease is no longer renewed.
        self.retired = False

    async def run(self) -> None:
        state = self.state
        try:
            while not (state.finished and not self._running and self.batcher.empty):
                if state.stopping and not self.retired:
                    # no new sequence comes to us, and our sequences' next requests meet the
                    # lost error (or, checkpointed, queue for the owner that takes them over)
                    self.retired = True
                    await self.ownership.retire()
                now_ns = self.clock_ns()
                await self.answering.expire(state.expired(now_ns))
                self._collect(now_ns)
                room = self.max_queued - self.batcher.queued
                await self._take(state.take_in_hand(room), now_ns)
                wait_ns = self._launch(now_ns)
                await self._release_idle(now_ns)
                if state.finished and not self._running:
                    await self._drop_all()
                    break
                state.wake.clear()
                if not self._running and self.answering.publisher.holds_statistics:
                    # a batch's statistics wait for a later one's while sequences are open:
                    # nothing runs now, so they are written (a read meanwhile wakes us)
                    await self.answering.publisher.publish([], [])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(state.wake.wait(), self._wait_s(wait_ns, now_ns))
        finally:
            self.retired = True
            await self.ownership.retire()

    def _collect(self, now_ns: int) -> None:
        """The batches that ran: their sequences may go on (their answers are written in the
        order their batches started, so a sequence's leave in its order), or leave their
        slots."""
        while self._done:
            ended = self.batcher.finished(self._running.pop(self._done.pop()), now_ns)
            if ended:
                self.duties.changed.set()
        self.state.sequences_running(self.batcher.holding)

    async def _take(self, items: list[Queued], now_ns: int) -> None:
        refused: list[tuple[Queued, Result]] = []
        elsewhere = [item for item in items if item.stream != self.ownership.stream]
        if elsewhere:
            await self.duties.forward(elsewhere)
        for item in items:
            if item.stream != self.ownership.stream:
                continue
            params = item.request.parameters
            key = params.get(SEQUENCE_ID)
            start, end = bool(params.get(SEQUENCE_START)), bool(params.get(SEQUENCE_END))
            if (
                self.keeper.checkpointed
                and key is not None
                and not start
                and key not in self.batcher.known
            ):
                replayed = await self.keeper.adopt(key, item, end, now_ns)
                if replayed is not None:
                    refused.append((item, replayed))
                    continue
            if key is None or not self.batcher.add(key, item, start, end, now_ns):
                error = start_missing(self.spec.name, key if key is not None else 0)
                refused.append((item, Result(item.request.id, error=(error.code, error.message))))
            elif start:
                self.duties.changed.set()
        await self.answering.reject(refused)

    def _launch(self, now_ns: int) -> int | None:
        """Start a batch on every free lane that has one; how long until one is due (ns)."""
        wait_ns: int | None = None
        for lane in list(self.state.free_lanes):
            decision = self.batcher.next_batch(lane, now_ns)
            if decision is None:
                continue
            if isinstance(decision, int):
                wait_ns = decision if wait_ns is None else min(wait_ns, decision)
                continue
            for member in decision:
                self.inputs.give(member)
                if self.inputs.states:
                    self.keeper.watch(member)
            batch_id = next(self._batch_ids)
            self._running[batch_id] = decision
            if self.batcher.rules.strategy == "direct":
                batch = self.inputs.null_filled(decision, now_ns)
            else:
                batch = [m.step.item for m in decision]
            self.state.lane_taken(lane)
            self.answering.start(
                Launch(lane, batch, inline=False), ran=partial(self._ran, batch_id)
            )
        return wait_ns

    def _ran(self, batch_id: int) -> None:
        self._done.append(batch_id)
        self.state.wake.set()

    async def _release_idle(self, now_ns: int) -> None:
        released = self.batcher.idle(now_ns)
        for sequence in released:
            log.info("%s: sequence %s idle, released", self.spec.name, sequence.key)
            try:
                await self.ownership.release(sequence.key)
            except REDIS_ERRORS as exc:  # its claim lapses with its lease
                log.warning("%s: releasing sequence %s: %s", self.spec.name, sequence.key, exc)
        if released:
            self.duties.changed.set()

    def _wait_s(self, wait_ns: int | None, now_ns: int) -> float | None:
        idle_at_ns = self.batcher.next_idle_ns()
        if idle_at_ns is not None:
            idle_ns = max(0, idle_at_ns - now_ns)
            wait_ns = idle_ns if wait_ns is None else min(wait_ns, idle_ns)
        return None if wait_ns is None else wait_ns / 1e9

    async def _drop_all(self) -> None:
        """Stopping with sequences still open: their queued requests are answered with the
        lost-sequence error (their claims go with our lease), unless their state is kept: then
        they stay on our stream, unanswered, for the owner that takes our sequences over."""
        sequences = [*self.batcher.slotted.values(), *self.batcher.backlog]
        left = self.batcher.drop(sequences)
        if not self.keeper.checkpointed:
            await self.answering.reject([(s.item, self.duties.lost(s.item.request)) for s in left])

    async def keep_ownership(self) -> None:
        """Our duties as an owner (owner_duties.py), until we retire."""
        await self.duties.keep(lambda: self.retired, self._forfeit)

    def _forfeit(self) -> None:
        """We were taken for dead: our sequences are no longer ours (their queued requests
        were answered, or moved to the owner that took them)."""
        self.batcher.drop([*self.batcher.slotted.values(), *self.batcher.backlog])
