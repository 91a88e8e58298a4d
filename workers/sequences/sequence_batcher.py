"""Triton's sequence batcher, as a pure scheduler: which slot each sequence holds and which of
their requests form an instance's next batch.

Every instance has slots (`direct`: max_batch_size of them; `oldest`: max_candidate_sequences).
A sequence's START takes the lowest free slot, or waits in the backlog, in order, until one
frees; its later requests follow it to that slot, one of them per batch. A batch of the
`direct` strategy holds the next request of every slot of the instance that has one, in slot
order; one of the `oldest` strategy holds those of the oldest sequences, up to
max_batch_size, and waits up to `max_queue_delay_microseconds` for a fuller one unless it
reached a preferred size (`direct` waits likewise while too few slots are ready, as its
`minimum_slot_utilization` says).

As in Triton: a request that does not start a sequence must belong to one this batcher knows
(in a slot or in the backlog); once a sequence's END is queued the id is forgotten, so a new
START with it is a new sequence; a START for a sequence still running continues it (its model
sees the START); a sequence with no request for `max_sequence_idle_microseconds` is released
and forgotten. This module only decides; the loop (sequence_loop.py) runs what it decides.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

T = TypeVar("T")

SequenceId = int | str
Strategy = Literal["direct", "oldest"]


@dataclass(frozen=True, slots=True, order=True)
class Slot:
    instance: int
    index: int


@dataclass(frozen=True, slots=True)
class Step(Generic[T]):
    """One request of a sequence, as queued."""

    item: T
    start: bool
    end: bool
    arrived_ns: int


@dataclass(slots=True, eq=False)
class Sequence(Generic[T]):
    key: SequenceId
    #: in starting order: the `oldest` strategy batches older sequences first.
    order: int
    last_ns: int
    queue: deque[Step[T]] = field(default_factory=deque)
    slot: Slot | None = None
    #: one of its requests is in a batch that has not finished.
    running: bool = False
    #: its END was queued: it leaves its slot once that has run.
    ending: bool = False
    #: its implicit state after its last step (the loop's; None: it starts from the initial).
    state: Any = None


@dataclass(frozen=True, slots=True)
class Rules:
    strategy: Strategy
    instances: int
    #: slots per instance.
    slots: int
    #: requests per batch (at least 1).
    max_batch_size: int
    idle_ns: int
    #: how long a batch may wait to fill (0: it goes as soon as its instance is free).
    delay_ns: int = 0
    preferred_batch_sizes: frozenset[int] = frozenset()
    #: `direct`: the share of an instance's slots a batch waits for, up to `delay_ns`.
    minimum_slot_utilization: float = 0.0


@dataclass(frozen=True, slots=True)
class Member(Generic[T]):
    """A request in a batch, with its sequence."""

    sequence: Sequence[T]
    step: Step[T]


class SequenceBatcher(Generic[T]):
    """One model's sequences on one worker: slots, backlog, batches and idle release."""

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        #: sequences a request may still name (started, not ended or released).
        self.known: dict[SequenceId, Sequence[T]] = {}
        #: the sequence holding each taken slot.
        self.slotted: dict[Slot, Sequence[T]] = {}
        self.free = sorted(Slot(i, s) for i in range(rules.instances) for s in range(rules.slots))
        self.backlog: deque[Sequence[T]] = deque()
        self._order = itertools.count()

    @property
    def empty(self) -> bool:
        """No sequence holds a slot or waits for one."""
        return not self.slotted and not self.backlog

    @property
    def queued(self) -> int:
        """Requests queued for their sequences, not yet in a batch."""
        return sum(len(s.queue) for s in (*self.slotted.values(), *self.backlog))

    @property
    def holding(self) -> int:
        """Sequences in a slot or the backlog (the sequences this worker owns)."""
        return len(self.slotted) + len(self.backlog)

    def add(self, key: SequenceId, item: T, start: bool, end: bool, now_ns: int) -> bool:
        """Queue a request; False when it names a sequence this batcher does not know and does
        not start one (Triton's START error)."""
        sequence = self.known.get(key)
        if sequence is None:
            if not start:
                return False
            sequence = Sequence(key, next(self._order), now_ns)
            self.known[key] = sequence
            self._place(sequence)
        sequence.queue.append(Step(item, start, end, now_ns))
        sequence.last_ns = now_ns
        if end:
            sequence.ending = True
            del self.known[key]
        return True

    def adopt(self, key: SequenceId, state: Any, now_ns: int) -> None:
        """Go on with a sequence another worker ran (it died), from its kept `state`."""
        sequence: Sequence[T] = Sequence(key, next(self._order), now_ns, state=state)
        self.known[key] = sequence
        self._place(sequence)

    def _place(self, sequence: Sequence[T]) -> None:
        if self.free:
            sequence.slot = self.free.pop(0)
            self.slotted[sequence.slot] = sequence
        else:
            self.backlog.append(sequence)

    def next_batch(self, instance: int, now_ns: int) -> list[Member[T]] | int | None:
        """The batch to run on a free `instance` now (taken from the queues), how long to wait
        for a fuller one (ns), or None when none of its sequences has a request."""
        ready = [
            s
            for slot, s in self.slotted.items()
            if slot.instance == instance and s.queue and not s.running
        ]
        if not ready:
            return None
        rules = self.rules
        if rules.strategy == "direct":
            ready.sort(key=lambda s: s.slot or Slot(0, 0))
            full = len(ready) >= rules.minimum_slot_utilization * rules.slots
        else:
            ready.sort(key=lambda s: s.order)
            ready = ready[: rules.max_batch_size]
            full = len(ready) >= rules.max_batch_size or len(ready) in rules.preferred_batch_sizes
        if not full and rules.delay_ns:
            waited_ns = now_ns - min(s.queue[0].arrived_ns for s in ready)
            if waited_ns < rules.delay_ns:
                return rules.delay_ns - waited_ns
        members = []
        for sequence in ready:
            sequence.running = True
            members.append(Member(sequence, sequence.queue.popleft()))
        return members

    def finished(self, members: list[Member[T]], now_ns: int) -> list[Sequence[T]]:
        """A batch ran: its sequences may take their next request; those whose END ran leave
        their slot to the backlog's first. Returns the sequences that ended."""
        ended = []
        for member in members:
            sequence = member.sequence
            sequence.running = False
            sequence.last_ns = max(sequence.last_ns, now_ns)
            if sequence.ending and not sequence.queue:  # its END ran, or it was dropped
                self._leave(sequence)
                ended.append(sequence)
        return ended

    def _leave(self, sequence: Sequence[T]) -> None:
        """The sequence gives up its slot (or its place in the backlog)."""
        if sequence.slot is None:
            self.backlog.remove(sequence)
            return
        del self.slotted[sequence.slot]
        slot, sequence.slot = sequence.slot, None
        if self.backlog:
            waiting = self.backlog.popleft()
            waiting.slot = slot
            self.slotted[slot] = waiting
        else:
            self.free.append(slot)
            self.free.sort()

    def idle(self, now_ns: int) -> list[Sequence[T]]:
        """Release the sequences with no request for the idle time (nothing queued or
        running): they are forgotten, and their slots go to the backlog."""
        released = [
            s
            for s in self.known.values()
            if not s.queue and not s.running and now_ns - s.last_ns >= self.rules.idle_ns
        ]
        for sequence in released:
            del self.known[sequence.key]
            self._leave(sequence)
        return released

    def next_idle_ns(self) -> int | None:
        """When `idle` may next release a sequence (wall time, ns)."""
        return min((s.last_ns + self.rules.idle_ns for s in self.known.values()), default=None)

    def drop(self, sequences: list[Sequence[T]]) -> list[Step[T]]:
        """Forget `sequences` whatever they hold (their worker is stopping or their model
        failed); the requests still queued for them are returned, to be answered."""
        left: list[Step[T]] = []
        for sequence in sequences:
            left.extend(sequence.queue)
            sequence.queue.clear()
            sequence.ending = True  # a running one leaves its slot once its batch finished
            if self.known.get(sequence.key) is sequence:
                del self.known[sequence.key]
            if not sequence.running:
                self._leave(sequence)
        return left
