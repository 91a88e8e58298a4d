"""The batch decision: a pure function of (pending requests, now), after Triton's GetDynamicBatch.

It returns "send these now" or "wait this long"; the worker loop does the I/O and the sleeping.
Unlike Triton, requests whose variable dims differ are grouped by shape rather than cutting
the batch at the first mismatch: each group is judged on its own, oldest group first. And
with an adaptive delay (sluice's default), when no group is due but the model's requests
arrive further apart than the delay, the oldest group goes at once instead of waiting:
waiting would cost the delay and, on average, bring less than one more request. The delay
stays a ceiling, never a floor.
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
    #: skip the wait while arrivals are further apart than the delay (False: Triton's wait).
    adaptive_delay: bool = False

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


class ArrivalGap:
    """A running mean of the gap between a model's arrivals, each gap capped at `cap_ns`.

    The cap keeps one long quiet spell from hiding the burst that follows it: a few close
    arrivals bring the mean back under the delay.
    """

    WEIGHT = 0.125

    def __init__(self, cap_ns: int) -> None:
        self.cap_ns = cap_ns
        #: None until two arrivals were seen.
        self.mean_ns: float | None = None
        self._last_ns: int | None = None

    def observe(self, at_ns: int) -> None:
        last = self._last_ns
        if last is None or at_ns > last:
            self._last_ns = at_ns
        if last is None:
            return
        gap = min(max(0, at_ns - last), self.cap_ns)
        mean = self.mean_ns
        self.mean_ns = gap if mean is None else mean + (gap - mean) * self.WEIGHT


#: a run is made on the worker's event loop only if the model's last run took no longer.
INLINE_RUN_LIMIT_NS = 5_000_000


def runs_inline(
    instance_count: int, others_pending: bool, last_run_ns: int | None, spacing_ns: float | None
) -> bool:
    """Whether to run the next batch on the event loop's own thread rather than the instance's.

    Handing a batch to the instance thread and its results back costs two thread wakes, each
    waiting for the GIL while the loop goes on: at concurrency 1, a visible share of a request
    (benchmarks/RESULTS.md has the per-stage trace).
    Running in place saves them when the loop has nothing else to do meanwhile: the model has
    one instance, nothing else waits, requests arrive further apart than a run takes, and runs
    are short enough not to hold up the loop's heartbeats. Under load, the instance thread
    keeps the loop reading and publishing while the model runs. A model that must never run
    on the loop (a Triton Python model, whose BLS calls may wait on this worker's own loop)
    reports no run time (`last_run_ns` None).
    """
    return (
        instance_count == 1
        and not others_pending
        and last_run_ns is not None
        and last_run_ns <= INLINE_RUN_LIMIT_NS
        and spacing_ns is not None
        and spacing_ns > last_run_ns
    )


def next_batch(
    pending: Sequence[Pending], now_ns: int, rules: BatchRules, arrival_gap_ns: float | None = None
) -> Send | Wait:
    """The batch to run now, or how long to wait for one (None: until a request arrives).

    `arrival_gap_ns` is the mean gap between recent arrivals (None: not known yet).
    """
    if not pending:
        return Wait(None)
    if not rules.dynamic or rules.max_batch_size == 0:
        return Send((0,))
    groups: dict[Hashable, list[int]] = {}
    for index, item in enumerate(pending):
        groups.setdefault(item.group, []).append(index)
    shortest_wait_ns: int | None = None
    for members in groups.values():
        decision = _judge_group(pending, members, now_ns, rules)
        if isinstance(decision, Send):
            return decision
        if shortest_wait_ns is None or (decision.ns is not None and decision.ns < shortest_wait_ns):
            shortest_wait_ns = decision.ns
    sparse = arrival_gap_ns is not None and arrival_gap_ns > rules.max_queue_delay_ns
    if rules.adaptive_delay and sparse:
        # nothing is due, and waiting would not bring another request: the oldest group goes
        return _judge_group(pending, next(iter(groups.values())), now_ns, rules, send_now=True)
    return Wait(shortest_wait_ns)


def _judge_group(
    pending: Sequence[Pending],
    members: list[int],
    now_ns: int,
    rules: BatchRules,
    send_now: bool = False,
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
    age_ns = now_ns - pending[members[0]].start_ns
    delay_ns = rules.max_queue_delay_ns
    delay_exceeded = delay_ns != 0 and age_ns >= delay_ns
    if mark is not None and not delay_exceeded:
        return Send(tuple(members[:mark]))
    if full or size >= rules.max_preferred or delay_exceeded or delay_ns == 0 or send_now:
        return Send(tuple(members[:taken]))
    return Wait(delay_ns - age_ns)
