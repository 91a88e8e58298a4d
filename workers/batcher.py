"""The batch decision: a pure function of (pending requests, now), after Triton's GetDynamicBatch.

It returns "send these now" or "wait this long"; the worker loop does the I/O and the sleeping.
Unlike Triton, requests whose variable dims differ are grouped by shape rather than cutting
the batch at the first mismatch: each group is judged on its own, oldest group first.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchRules:
    """The subset of a model's batching config the decision needs (times in ns)."""

    max_batch_size: int
    dynamic: bool
    max_queue_delay_ns: int
    preferred_batch_sizes: frozenset[int]

    @property
    def max_preferred(self) -> int:
        return max(self.preferred_batch_sizes, default=self.max_batch_size)


@dataclass(frozen=True, slots=True)
class Pending:
    """What the decision knows of one queued request."""

    #: requests with equal keys (model version + shapes of variable inputs) can be stacked.
    group: Hashable
    #: the request's contribution to a batch: max(1, its batch dim).
    batch_size: int
    #: when its queue delay started counting (its enqueue time, on the worker's clock).
    start_ns: int


@dataclass(frozen=True, slots=True)
class Send:
    """Run these pending requests (indices into the pending sequence, FIFO order) as one batch."""

    indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing is ready: decide again after `ns`, or sooner if a request arrives."""

    ns: int | None


def next_batch(pending: Sequence[Pending], now_ns: int, rules: BatchRules) -> Send | Wait:
    """The batch to run now, or how long to wait for one (None: until a request arrives)."""
    if not pending:
        return Wait(None)
    if not rules.dynamic or rules.max_batch_size == 0:
        return Send((0,))
    groups: dict[Hashable, list[int]] = {}
    for index, item in enumerate(pending):
        groups.setdefault(item.group, []).append(index)
    shortest_wait: int | None = None
    for members in groups.values():
        decision = _judge_group(pending, members, now_ns, rules)
        if isinstance(decision, Send):
            return decision
        if shortest_wait is None or (decision.ns is not None and decision.ns < shortest_wait):
            shortest_wait = decision.ns
    return Wait(shortest_wait)


def _judge_group(
    pending: Sequence[Pending], members: list[int], now_ns: int, rules: BatchRules
) -> Send | Wait:
    """Triton's scan over one shape group, FIFO; requests are never split."""
    size = 0
    taken = 0
    mark: int | None = None  # how many requests make the best preferred batch
    full = False
    for index in members:
        item_size = pending[index].batch_size
        if size:
            if size + item_size > rules.max_preferred and mark is None:
                mark = taken
            if size + item_size > rules.max_batch_size:
                full = True
                break
        size += item_size
        taken += 1
        if size in rules.preferred_batch_sizes:
            mark = taken
    age = now_ns - pending[members[0]].start_ns
    delay = rules.max_queue_delay_ns
    delay_exceeded = delay != 0 and age >= delay
    if mark is not None and not delay_exceeded:
        return Send(tuple(members[:mark]))
    if full or size >= rules.max_preferred or delay_exceeded or delay == 0:
        return Send(tuple(members[:taken]))
    return Wait(delay - age)
