"""In-flight batching: which sequences take part in a generative model's next iteration.

A request to a generative model is a sequence that runs for many iterations (one token each).
Before every iteration the sequences that finished (or were cancelled) leave the running set
and waiting ones join it, so a short request never waits for the longest of a batch (Orca's
iteration-level scheduling; Triton's `sequence_batching { iterative_sequence: true }`).

Joining follows the queue's order: priority level first (1 the highest, as the queue policy's
levels), then arrival. Free slots are filled at the very next iteration, up to
`max_sequences`; with a token budget, a running sequence costs 1 token an iteration and a
joining one its prompt's tokens, and the oldest waiting sequence that does not fit holds the
ones behind it back (none overtakes it) until it fits, or joins alone into an empty set. A
running sequence is never paused for a newer one (TensorRT-LLM's default,
`guaranteed_no_evict`).

This module only decides; the model's state follows the `Iteration` it returns (rows kept in
order, joining ones after them).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Limits:
    #: sequences that run together (the model's max_batch_size).
    max_sequences: int
    #: tokens an iteration may compute (0: no budget).
    token_budget: int = 0


@dataclass(slots=True)
class Sequence(Generic[T]):
    """One request's generation, waiting or running."""

    key: str
    item: T
    level: int
    order: int
    prompt_tokens: int
    #: set by `finish` or `cancel`: it leaves before the next iteration.
    done: bool = False
    cancelled: bool = False

    def rank(self) -> tuple[int, int]:
        return (self.level, self.order)


@dataclass(frozen=True, slots=True)
class Iteration(Generic[T]):
    """What changes before an iteration: the rows of the running state kept (in order), the
    sequences that left it, and the ones that join it (appended after the kept rows)."""

    keep: list[int]
    left: list[Sequence[T]]
    joining: list[Sequence[T]]

    @property
    def changed(self) -> bool:
        return bool(self.left or self.joining)


@dataclass(slots=True)
class InflightScheduler(Generic[T]):
    """One model instance's running set and the queue that feeds it."""

    limits: Limits
    #: in the order of the model's state rows.
    running: list[Sequence[T]] = field(default_factory=list)
    #: in joining order: level, then arrival.
    waiting: list[Sequence[T]] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def room(self) -> int:
        """How many more requests to take in now: the slots that neither a staying sequence
        nor a waiting one will take at the next iteration."""
        staying = sum(not s.done for s in self.running)
        return max(0, self.limits.max_sequences - staying - len(self.waiting))

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def submit(self, key: str, item: T, level: int = 0, prompt_tokens: int = 1) -> None:
        """A new request waits for a slot."""
        sequence = Sequence(key, item, level, next(self._order), prompt_tokens)
        bisect.insort(self.waiting, sequence, key=Sequence.rank)

    def finish(self, key: str) -> None:
        """The sequence produced its last token: it leaves before the next iteration."""
        for sequence in self.running:
            if sequence.key == key:
                sequence.done = True

    def cancel(self, key: str) -> Sequence[T] | None:
        """Its client went away. A waiting sequence is returned at once; a running one leaves
        before the next iteration (in that iteration's `left`, marked cancelled)."""
        for index, sequence in enumerate(self.waiting):
            if sequence.key == key:
                sequence.cancelled = True
                return self.waiting.pop(index)
        for sequence in self.running:
            if sequence.key == key and not sequence.done:
                sequence.done = sequence.cancelled = True
        return None

    def drop(self, sequences: list[Sequence[T]]) -> None:
        """Sequences that failed to join (their prefill raised) leave the running set."""
        gone = {id(s) for s in sequences}
        self.running = [s for s in self.running if id(s) not in gone]

    def fail_running(self) -> list[Sequence[T]]:
        """The model failed on the whole running set: every running sequence leaves now."""
        failed, self.running = self.running, []
        return failed

    def next_iteration(self) -> Iteration[T]:
        """Let the finished sequences leave and the waiting ones join, as the limits allow."""
        keep = [i for i, s in enumerate(self.running) if not s.done]
        left = [s for s in self.running if s.done]
        kept = [self.running[i] for i in keep]
        joining = self._joining(len(kept))
        self.running = kept + joining
        return Iteration(keep, left, joining)

    def _joining(self, kept: int) -> list[Sequence[T]]:
        slots = self.limits.max_sequences - kept
        budget = self.limits.token_budget - kept if self.limits.token_budget else None
        count = 0
        for sequence in self.waiting:
            if count == slots:
                break
            if budget is not None:
                alone = kept == 0 and count == 0
                if sequence.prompt_tokens > budget and not alone:
                    break  # the oldest waits for room; nothing overtakes it
                budget -= sequence.prompt_tokens
            count += 1
        joining, self.waiting = self.waiting[:count], self.waiting[count:]
        return joining
