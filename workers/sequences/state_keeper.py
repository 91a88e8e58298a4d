"""A stateful sequence model's implicit state after each step, kept for the next one and, with
SEQUENCE_STATE_CHECKPOINT, in Redis, from where a worker goes on with a dead one's sequences.
"""

from __future__ import annotations

import logging

from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import Result, Tensor
from sluice.shared.sequence_routing import CLAIM_LEASE_MS
from sluice.workers.batching.pending import Queued
from sluice.workers.sequences.ownership import SequenceOwnership
from sluice.workers.sequences.sequence_batcher import Member, SequenceBatcher, SequenceId

log = logging.getLogger(__name__)


class StateKeeper:
    """Takes each step's state outputs out of its answers and keeps them with its sequence."""

    def __init__(
        self, spec: ModelSpec, ownership: SequenceOwnership, batcher: SequenceBatcher[Queued]
    ) -> None:
        self.model = spec.name
        self.states = spec.config.sequence_states
        self.ownership = ownership
        self.batcher = batcher
        #: the state outputs, which are the server's, not the client's.
        self._state_outputs = {s.output_name for s in self.states} - {o.name for o in spec.outputs}
        self.checkpointed = spec.config.sequence_checkpoint and bool(self.states)
        #: kept state lives as long as an idle sequence, and a dead owner's claims, may.
        self.ttl_ms = batcher.rules.idle_ns // 1_000_000 + CLAIM_LEASE_MS
        #: request id -> its place in its sequence, while its batch runs.
        self._members: dict[str, Member[Queued]] = {}

    def watch(self, member: Member[Queued]) -> None:
        """`member` runs now: its answer brings its sequence's next state."""
        self._members[member.step.item.request.id] = member

    async def keep(self, results: list[Result]) -> None:
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
                await self.ownership.checkpoint(key, state, result, self.ttl_ms)

    async def adopt(self, key: SequenceId, item: Queued, end: bool, now_ns: int) -> Result | None:
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
            log.info("%s: sequence %s taken over from its kept state", self.model, key)
        return result if replayed else None
