"""A sequence model's queue loop: Triton's sequence batcher over the requests this worker owns.

The reader reads only this worker's own sequence stream (shared/sequence_routing.py routes each
sequence's requests there); every request read goes to the `SequenceBatcher`, which keeps the
slots and says what each free instance runs next. Before a batch runs, each request gets the
config's control inputs (START, END, READY, CORRID) as Triton fills them in. After it ran, the
sequences whose END ran leave their slots; a sequence idle past its
`max_sequence_idle_microseconds` is released, here and in Redis. Alongside, `keep_ownership`
renews this worker's lease and claims and answers for owners that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from sluice.shared import keys
from sluice.shared.datatypes import element_count, serialize_bytes_elements
from sluice.shared.errors import SluiceError
from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import Request, Result, Tensor, encode_requests
from sluice.shared.redis_client import REDIS_ERRORS
from sluice.shared.sequence_controls import (
    SEQUENCE_END,
    SEQUENCE_ID,
    SEQUENCE_START,
    Flags,
    check_sequence_request,
)
from sluice.shared.sequence_routing import (
    CLAIM_LEASE_MS,
    RENEW_S,
    route_command,
    route_error,
    sequence_lost,
    start_missing,
)
from sluice.workers.batching.answering import Answering
from sluice.workers.batching.batcher import Pending
from sluice.workers.batching.pending import Queued
from sluice.workers.batching.queue_state import Launch, QueueState
from sluice.workers.sequences.ownership import SequenceOwnership
from sluice.workers.sequences.sequence_batcher import Member, Rules, SequenceBatcher

log = logging.getLogger(__name__)

#: requests a worker queues for its sequences, per slot, before it stops reading its stream.
MAX_QUEUED_PER_SLOT = 8


def sequence_rules(spec: ModelSpec) -> Rules:
    """The batcher's rules from the model's `sequence_batching` (Triton's defaults: `direct`,
    one candidate sequence per instance under `oldest`, an idle time of 1 s)."""
    config: dict[str, Any] = spec.config.json.get("sequence_batching") or {}
    idle_us = int(config.get("max_sequence_idle_microseconds") or 1_000_000)
    max_batch_size = max(1, spec.max_batch_size)
    if "oldest" in config:
        oldest = config["oldest"] or {}
        return Rules(
            "oldest",
            spec.instance_count,
            slots=max(1, int(oldest.get("max_candidate_sequences") or 1)),
            max_batch_size=max_batch_size,
            idle_ns=idle_us * 1000,
            delay_ns=int(oldest.get("max_queue_delay_microseconds") or 0) * 1000,
            preferred_batch_sizes=frozenset(
                int(size) for size in oldest.get("preferred_batch_size") or ()
            ),
        )
    direct = config.get("direct") or {}
    return Rules(
        "direct",
        spec.instance_count,
        slots=max_batch_size,
        max_batch_size=max_batch_size,
        idle_ns=idle_us * 1000,
        delay_ns=int(direct.get("max_queue_delay_microseconds") or 0) * 1000,
        minimum_slot_utilization=float(direct.get("minimum_slot_utilization") or 0.0),
    )


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
        self.controls = spec.config.sequence_controls
        self.states = spec.config.sequence_states
        #: the state outputs, which are the server's, not the client's.
        self._state_outputs = {s.output_name for s in self.states} - {o.name for o in spec.outputs}
        self.checkpointed = spec.config.sequence_checkpoint and bool(self.states)
        #: kept state lives as long as an idle sequence, and a dead owner's claims, may
        self.checkpoint_ttl_ms = self.batcher.rules.idle_ns // 1_000_000 + CLAIM_LEASE_MS
        #: request id -> its place in its sequence, while its batch runs (a stateful model's).
        self._members: dict[str, Member[Queued]] = {}
        if self.states:
            answering.results_hook = self._keep_states
        self.batched = spec.max_batch_size > 0
        self.clock_ns = clock_ns
        #: requests queued for their sequences at most; past it the reader stops reading.
        rules = self.batcher.rules
        self.max_queued = MAX_QUEUED_PER_SLOT * rules.instances * rules.slots
        #: the batches running or being answered, by number.
        self._running: dict[int, list[Member[Queued]]] = {}
        self._batch_ids = itertools.count()
        #: the batches whose answers were written since the loop last looked.
        self._published: list[int] = []
        self._changed = asyncio.Event()
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
        """The batches whose answers were written: their sequences may go on (so that a
        sequence's answers leave in its order), or leave their slots."""
        while self._published:
            ended = self.batcher.finished(self._running.pop(self._published.pop()), now_ns)
            if ended:
                self._changed.set()
        self.state.sequences_running(self.batcher.holding)

    async def _take(self, items: list[Queued], now_ns: int) -> None:
        refused: list[tuple[Queued, Result]] = []
        elsewhere = [item for item in items if item.stream != self.ownership.stream]
        if elsewhere:
            await self._forward(elsewhere)
        for item in items:
            if item.stream != self.ownership.stream:
                continue
            params = item.request.parameters
            key = params.get(SEQUENCE_ID)
            start, end = bool(params.get(SEQUENCE_START)), bool(params.get(SEQUENCE_END))
            if (
                self.checkpointed
                and key is not None
                and not start
                and key not in self.batcher.known
            ):
                replayed = await self._adopt(key, item, end, now_ns)
                if replayed is not None:
                    refused.append((item, replayed))
                    continue
            if key is None or not self.batcher.add(key, item, start, end, now_ns):
                error = start_missing(self.spec.name, key if key is not None else 0)
                refused.append((item, Result(item.request.id, error=(error.code, error.message))))
            elif start:
                self._changed.set()
        await self.answering.reject(refused)

    async def _forward(self, items: list[Queued]) -> None:
        """Requests read from the model's own streams (put there by a job, a BLS call, the
        direct client) go to the owner of their sequence, as a gateway would route them."""
        refused: list[tuple[Queued, Result]] = []
        sent: list[Queued] = []
        for item in items:
            request = item.request
            try:
                check_sequence_request(self.spec.name, request.parameters, item.pending.batch_size)
                command = route_command(
                    self.spec.name,
                    request.parameters,
                    encode_requests([request]),
                    self.checkpointed,
                )
                error = route_error(
                    self.spec.name,
                    request.parameters[SEQUENCE_ID],
                    await self.ownership.redis.execute_command(*command),
                )
            except SluiceError as exc:
                error = exc
            if error is None:
                sent.append(item)
            else:
                refused.append((item, Result(request.id, error=(error.code, error.message))))
        await self.answering.reject(refused)
        await self.answering.publisher.forwarded(sent)

    async def _adopt(self, key: int | str, item: Queued, end: bool, now_ns: int) -> Result | None:
        """A request of a sequence we do not hold, moved to us from an owner that died: go on
        from the state it kept. If that owner ran this very request but died before answering
        it, the kept result answers it (returned), so no step runs twice."""
        kept = await self.ownership.restore(key)
        if kept is None:
            return None  # never started, ended, or idle too long: Triton's START error follows
        state, last_id, result = kept
        replayed = item.request.id == last_id
        if not (replayed and end):
            self.batcher.adopt(key, state, now_ns)
            log.info("%s: sequence %s taken over from its kept state", self.spec.name, key)
        return result if replayed else None

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
                self._prepare(member)
            batch_id = next(self._batch_ids)
            self._running[batch_id] = decision
            batch = [m.step.item for m in decision]
            if self.batcher.rules.strategy == "direct":
                batch = self._null_filled(decision, batch, now_ns)
            self.state.lane_taken(lane)
            self.answering.start(
                Launch(lane, batch, inline=False), published=partial(self._answered, batch_id)
            )
        return wait_ns

    def _null_filled(
        self, members: list[Member[Queued]], batch: list[Queued], now_ns: int
    ) -> list[Queued]:
        """A `direct` batch holds slots 0 up to its highest ready one, in order: an empty slot
        below it gets a null request, as Triton gives one (the first request's inputs as
        zeros, READY, START and END false, CORRID 0), whose answer is dropped."""
        slots = [m.sequence.slot.index if m.sequence.slot else 0 for m in members]
        if slots == list(range(len(slots))):
            return batch
        by_slot = dict(zip(slots, batch, strict=True))
        model = batch[0]
        return [by_slot.get(i) or self._null(model, now_ns) for i in range(max(slots) + 1)]

    def _null(self, model: Queued, now_ns: int) -> Queued:
        real = model.request
        zeros = [Tensor(t.name, t.datatype, t.shape, _zeros(t)) for t in real.inputs]
        names = {c.name for c in self.controls} | {s.input_name for s in self.states}
        flags = Flags(0, ready=False)
        inputs = [t for t in zeros if t.name not in names] + [
            c.wire(flags, self.batched) for c in self.controls
        ]
        inputs += [s.initial(self.batched) for s in self.states]
        request = Request(
            f"null:{next(self._batch_ids)}", real.version, now_ns, "", inputs, real.outputs
        )
        return Queued(request, model.stream, b"", model.pending, filler=True)

    def _answered(self, batch_id: int) -> None:
        self._published.append(batch_id)
        self.state.wake.set()

    def _prepare(self, member: Member[Queued]) -> None:
        """The request's control inputs, and its implicit state: the initial one on START,
        else its sequence's after the last step (its state output asked for)."""
        request: Request = member.step.item.request
        flags = Flags(member.sequence.key, start=member.step.start, end=member.step.end)
        given = [c.wire(flags, self.batched) for c in self.controls]
        if self.states:
            held = None if member.step.start else member.sequence.state
            given += held if held is not None else [s.initial(self.batched) for s in self.states]
            if request.outputs is not None:
                wanted = [
                    s.output_name for s in self.states if s.output_name not in request.outputs
                ]
                request.outputs = (*request.outputs, *wanted)
            self._members[request.id] = member
        names = {t.name for t in given}
        request.inputs = [t for t in request.inputs if t.name not in names] + given

    async def _keep_states(self, results: list[Result]) -> None:
        """After a step: each sequence keeps its state output as its next state input (and,
        checkpointing, in Redis), and the client gets the model's other outputs."""
        for result in results:
            member = self._members.pop(result.id, None)
            if member is None:
                continue
            returned = {t.name: t for t in result.outputs}
            result.outputs = [t for t in result.outputs if t.name not in self._state_outputs]
            if result.error is not None or any(s.output_name not in returned for s in self.states):
                continue
            state = [
                Tensor(s.input_name, t.datatype, t.shape, bytes(t.data))
                for s, t in ((s, returned[s.output_name]) for s in self.states)
            ]
            member.sequence.state = state
            if not self.checkpointed:
                continue
            key = member.sequence.key
            if member.step.end:
                await self.ownership.forget(key)
            else:
                await self.ownership.checkpoint(key, state, result, self.checkpoint_ttl_ms)

    async def _release_idle(self, now_ns: int) -> None:
        released = self.batcher.idle(now_ns)
        for sequence in released:
            log.info("%s: sequence %s idle, released", self.spec.name, sequence.key)
            try:
                await self.ownership.release(sequence.key)
            except REDIS_ERRORS as exc:  # its claim lapses with its lease
                log.warning("%s: releasing sequence %s: %s", self.spec.name, sequence.key, exc)
        if released:
            self._changed.set()

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
        if self.checkpointed:
            return
        refused = []
        for step in left:
            request = step.item.request
            error = sequence_lost(self.spec.name, request.parameters.get(SEQUENCE_ID, 0))
            refused.append((step.item, Result(request.id, error=(error.code, error.message))))
        await self.answering.reject(refused)

    async def keep_ownership(self) -> None:
        """Renew our lease and claims every `RENEW_S` (and when sequences come or go), and
        answer the requests of owners that died."""
        while not self.retired:
            held = list(self.batcher.known)
            await self.ownership.renew(held, self.batcher.holding)
            for owner in await self.ownership.lapsed():
                if self.checkpointed:
                    moved = await self.ownership.take_over(owner)
                    if moved >= 0:
                        log.warning(
                            "%s: worker %s died: its sequences go on here (%d requests moved)",
                            *(self.spec.name, owner, moved),
                        )
                elif await self.ownership.bury(owner):
                    await self._answer_orphans(owner)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), RENEW_S)

    async def _answer_orphans(self, owner: str) -> None:
        requests = await self.ownership.orphans(owner)
        if requests:
            log.warning(
                "%s: worker %s died holding sequences: %d requests answered as lost",
                *(self.spec.name, owner, len(requests)),
            )
        stream = keys.sequence_stream(self.spec.name, owner)
        await self.answering.reject(
            [(_orphan(request, stream), _lost(self.spec.name, request)) for request in requests]
        )


def _lost(model: str, request: Request) -> Result:
    error: SluiceError = sequence_lost(model, request.parameters.get(SEQUENCE_ID, 0))
    return Result(request.id, error=(error.code, error.message))


def _orphan(request: Request, stream: str) -> Queued:
    """A request read off a dead owner's (deleted) stream, to be answered."""
    return Queued(request, stream, b"0-0", Pending(None, 1, 0))


def _zeros(tensor: Tensor) -> bytes:
    """`tensor`'s data with every element zero (empty, for BYTES)."""
    if tensor.datatype == "BYTES":
        return serialize_bytes_elements([b""] * element_count(tensor.shape))
    return bytes(len(tensor.data))
