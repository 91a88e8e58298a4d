"""The batch decision (workers/batching/batcher.py) against Triton's GetDynamicBatch, with a fake
clock."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sluice.workers.batching.batcher import (
    INLINE_RUN_LIMIT_NS,
    ArrivalGap,
    BatchRules,
    Pending,
    Send,
    Wait,
    next_batch,
    runs_inline,
)

US = 1_000  # ns per microsecond
T0 = 1_000_000_000_000  # an arbitrary steady-clock reading for the oldest request


def rules(
    max_batch_size: int = 8,
    delay_us: int = 0,
    preferred: Sequence[int] = (),
    dynamic: bool = True,
    adaptive: bool = False,
) -> BatchRules:
    return BatchRules(
        max_batch_size=max_batch_size,
        dynamic=dynamic,
        max_queue_delay_ns=delay_us * US,
        preferred_batch_sizes=frozenset(preferred),
        adaptive_delay=adaptive,
    )


def queue(
    *sizes: int, group: Hashable = "g", start: int = T0, step: int = 10 * US
) -> list[Pending]:
    """Requests of one group, each `step` ns younger than the previous one."""
    return [Pending(group, size, start + i * step) for i, size in enumerate(sizes)]


# --- trivial cases -------------------------------------------------------------------------


def test_empty_queue_waits_for_a_request() -> None:
    assert next_batch([], T0, rules(delay_us=100)) == Wait(None)
    assert next_batch([], T0, rules(dynamic=False)) == Wait(None)


def test_without_dynamic_batching_requests_go_one_at_a_time() -> None:
    pending = queue(1, 1, 1)
    assert next_batch(pending, T0, rules(dynamic=False, delay_us=1000)) == Send((0,))


def test_max_batch_size_zero_sends_one_at_a_time() -> None:
    pending = queue(1, 1, 1)
    assert next_batch(pending, T0, rules(max_batch_size=0, delay_us=1000)) == Send((0,))


# --- delay 0 and max_batch_size ------------------------------------------------------------


def test_delay_zero_sends_everything_pending() -> None:
    pending = queue(1, 2, 1)
    assert next_batch(pending, T0, rules(delay_us=0)) == Send((0, 1, 2))


def test_delay_zero_sends_at_most_max_batch_size() -> None:
    pending = queue(*[1] * 11)
    assert next_batch(pending, T0, rules(delay_us=0)) == Send(tuple(range(8)))


def test_delay_zero_with_normalised_preferred_size() -> None:
    # config normalisation makes preferred = [max_batch_size]; nothing changes for delay 0
    pending = queue(1, 1, 1)
    assert next_batch(pending, T0, rules(delay_us=0, preferred=[8])) == Send((0, 1, 2))


def test_reaching_max_batch_size_sends_before_the_delay() -> None:
    pending = queue(*[1] * 8)
    decision = next_batch(pending, T0 + 1 * US, rules(delay_us=1_000_000))
    assert decision == Send(tuple(range(8)))


def test_request_that_would_exceed_max_closes_the_batch() -> None:
    # 3 + 4 = 7, adding 2 would make 9 > 8: send the first two, even with a long delay left
    pending = queue(3, 4, 2)
    assert next_batch(pending, T0, rules(delay_us=1_000_000)) == Send((0, 1))


def test_a_request_batch_dim_counts_in_full_and_is_never_split() -> None:
    # 5 + 4 = 9 > 8: the second request is not split to fill the batch
    pending = queue(5, 4)
    assert next_batch(pending, T0, rules(delay_us=1_000_000)) == Send((0,))


def test_single_request_of_max_size_goes_at_once() -> None:
    assert next_batch(queue(8), T0, rules(delay_us=1_000_000)) == Send((0,))


# --- preferred sizes -----------------------------------------------------------------------


def test_preferred_size_sent_before_the_delay() -> None:
    pending = queue(1, 1, 1, 1, 1)
    decision = next_batch(pending, T0 + 100 * US, rules(delay_us=1000, preferred=[4, 8]))
    assert decision == Send((0, 1, 2, 3))


def test_largest_preferred_size_reached_wins() -> None:
    pending = queue(1, 1, 1, 1, 1, 1, 1)  # 7: reaches 2 and 4 and 6, not 8
    decision = next_batch(pending, T0, rules(delay_us=1000, preferred=[2, 4, 6, 8]))
    assert decision == Send(tuple(range(6)))


def test_delay_exceeded_sends_the_whole_pending_batch_not_a_preferred_size() -> None:
    pending = queue(1, 1, 1, 1, 1)
    decision = next_batch(pending, T0 + 1000 * US, rules(delay_us=1000, preferred=[4, 8]))
    assert decision == Send((0, 1, 2, 3, 4))


def test_below_every_preferred_size_waits() -> None:
    pending = queue(1, 1, 1)
    decision = next_batch(pending, T0 + 100 * US, rules(delay_us=1000, preferred=[4, 8]))
    assert decision == Wait(900 * US)


def test_preferred_size_with_delay_zero_still_sends_the_preferred_size() -> None:
    # Triton: best_preferred_batch_size is checked before the "delay == 0" rule
    pending = queue(1, 1, 1)
    assert next_batch(pending, T0, rules(delay_us=0, preferred=[2, 8])) == Send((0, 1))


def test_pending_at_max_preferred_sends() -> None:
    pending = queue(2, 2, 1)
    decision = next_batch(pending, T0, rules(delay_us=1000, preferred=[4]))
    assert decision == Send((0, 1))


def test_passing_max_preferred_without_a_preferred_hit_cuts_before_it() -> None:
    # Triton core (best_preferred_batch_size = pending_batch_size_ when the next request would
    # pass the largest preferred size): 3 fits, 3 + 3 = 6 > 4, so the mark stays after request 0
    pending = queue(3, 3)
    decision = next_batch(pending, T0, rules(delay_us=1000, preferred=[4]))
    assert decision == Send((0,))
    # ... but once the delay is exceeded the whole pending batch goes
    decision = next_batch(pending, T0 + 1000 * US, rules(delay_us=1000, preferred=[4]))
    assert decision == Send((0, 1))


# --- delay arithmetic ----------------------------------------------------------------------


def test_wait_is_measured_from_the_oldest_request() -> None:
    pending = [Pending("g", 1, T0), Pending("g", 1, T0 + 300 * US), Pending("g", 1, T0 + 490 * US)]
    r = rules(delay_us=1000)
    assert next_batch(pending, T0 + 500 * US, r) == Wait(500_000)
    assert next_batch(pending, T0 + 999 * US, r) == Wait(1_000)
    assert next_batch(pending, T0 + 1000 * US, r) == Send((0, 1, 2))
    assert next_batch(pending, T0 + 5000 * US, r) == Send((0, 1, 2))


def test_wait_is_exact_to_the_nanosecond() -> None:
    pending = queue(1, 1)
    assert next_batch(pending, T0 + 1, rules(delay_us=1000)) == Wait(999_999)
    assert next_batch(pending, T0 + 999_999, rules(delay_us=1000)) == Wait(1)
    assert next_batch(pending, T0 + 1_000_000, rules(delay_us=1000)) == Send((0, 1))


# --- shape groups --------------------------------------------------------------------------


def test_different_groups_are_not_stacked() -> None:
    pending = [Pending("a", 1, T0), Pending("b", 1, T0 + 1), Pending("a", 1, T0 + 2)]
    # delay 0: the oldest group goes, alone
    assert next_batch(pending, T0 + 10, rules(delay_us=0)) == Send((0, 2))


def test_group_of_the_oldest_request_is_judged_first() -> None:
    pending = [Pending("b", 1, T0), Pending("a", 1, T0 + 1), Pending("a", 1, T0 + 2)]
    assert next_batch(pending, T0 + 10, rules(delay_us=0)) == Send((0,))
    # both groups past the delay: still the oldest group first
    assert next_batch(pending, T0 + 2000 * US, rules(delay_us=1000)) == Send((0,))


def test_full_later_group_goes_while_the_oldest_group_waits() -> None:
    pending = [Pending("a", 1, T0)] + [Pending("b", 2, T0 + (i + 1) * US) for i in range(4)]
    decision = next_batch(pending, T0 + 100 * US, rules(delay_us=1000))
    assert decision == Send((1, 2, 3, 4))


def test_later_group_at_a_preferred_size_goes_while_the_oldest_waits() -> None:
    pending = [Pending("a", 1, T0), Pending("b", 2, T0 + 1), Pending("b", 2, T0 + 2)]
    decision = next_batch(pending, T0 + 10, rules(delay_us=1000, preferred=[4, 8]))
    assert decision == Send((1, 2))


def test_interleaved_groups_keep_fifo_order_within_a_group() -> None:
    pending = [
        Pending("a", 1, T0),
        Pending("b", 1, T0 + 1),
        Pending("a", 1, T0 + 2),
        Pending("b", 1, T0 + 3),
    ]
    r = rules(delay_us=1000)
    assert next_batch(pending, T0 + 1000 * US, r) == Send((0, 2))
    # once "a" is gone, "b" follows in its own order
    rest = [pending[1], pending[3]]
    assert next_batch(rest, T0 + 1000 * US + 1, r) == Send((0, 1))


def test_interleaved_groups_cut_at_max_batch_size_within_the_group() -> None:
    pending = [Pending("a" if i % 2 == 0 else "b", 3, T0 + i) for i in range(6)]
    # group a = indices 0, 2, 4 of size 3: 3 + 3 fits, a third would make 9 > 8
    assert next_batch(pending, T0 + 10, rules(delay_us=0)) == Send((0, 2))


def test_wait_is_the_shortest_over_groups() -> None:
    pending = [
        Pending("a", 1, T0),  # waits 1000 - 100 = 900 us
        Pending("b", 1, T0 + 50 * US),  # waits 1000 - 50 = 950 us
        Pending("c", 1, T0 + 60 * US),
    ]
    assert next_batch(pending, T0 + 100 * US, rules(delay_us=1000)) == Wait(900 * US)
    # the shortest wait may belong to a later group: here "b" (started earlier than "a")
    skewed = [Pending("a", 1, T0 + 50 * US), Pending("b", 1, T0)]
    assert next_batch(skewed, T0 + 100 * US, rules(delay_us=1000)) == Wait(900 * US)


def test_groups_wait_on_their_own_oldest_member() -> None:
    pending = [Pending("a", 1, T0), Pending("b", 1, T0 + 600 * US)]
    r = rules(delay_us=1000)
    assert next_batch(pending, T0 + 1000 * US, r) == Send((0,))
    # with "a" gone, "b" has waited only 400 us of its own
    assert next_batch(pending[1:], T0 + 1000 * US, r) == Wait(600 * US)


# --- property ------------------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Pending], int, BatchRules]:
    max_batch = draw(st.integers(1, 16))
    preferred = draw(st.frozensets(st.integers(1, max_batch), max_size=4))
    r = BatchRules(
        max_batch_size=max_batch,
        dynamic=True,
        max_queue_delay_ns=draw(st.sampled_from([0, 1, 1000, 10**6, 10**9])),
        preferred_batch_sizes=preferred,
    )
    items = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["a", "b", "c"]),
                st.integers(1, max_batch),
                st.integers(0, 10**7),
            ),
            max_size=20,
        )
    )
    # FIFO: start times are non-decreasing in queue order
    starts = sorted(start for _, _, start in items)
    pending = [
        Pending(group, size, T0 + start)
        for (group, size, _), start in zip(items, starts, strict=True)
    ]
    now = T0 + draw(st.integers(0, 2 * 10**7))
    return pending, now, r


@given(scenarios())
def test_decision_is_always_a_valid_batch_or_a_positive_wait(
    scenario: tuple[list[Pending], int, BatchRules],
) -> None:
    pending, now, r = scenario
    decision = next_batch(pending, now, r)
    if isinstance(decision, Wait):
        if not pending:
            assert decision.ns is None
        else:
            assert decision.ns is not None
            assert decision.ns > 0
            assert r.max_queue_delay_ns > 0
            # nobody has waited the whole delay yet
            assert all(now - p.start_ns < r.max_queue_delay_ns for p in pending)
        return
    assert isinstance(decision, Send)
    indices = decision.indices
    assert indices
    assert list(indices) == sorted(set(indices))
    group = pending[indices[0]].group
    assert all(pending[i].group == group for i in indices)
    members = [i for i, p in enumerate(pending) if p.group == group]
    assert list(indices) == members[: len(indices)]
    assert sum(pending[i].batch_size for i in indices) <= r.max_batch_size


@given(scenarios())
def test_delay_exceeded_for_the_oldest_never_waits(
    scenario: tuple[list[Pending], int, BatchRules],
) -> None:
    pending, now, r = scenario
    if pending and now - pending[0].start_ns >= r.max_queue_delay_ns:
        assert isinstance(next_batch(pending, now, r), Send)


# --- adaptive delay (sluice's default, beyond Triton) ----------------------------------------


def test_adaptive_delay_sends_at_once_while_arrivals_are_further_apart_than_the_delay() -> None:
    pending = queue(1, 1)
    r = rules(delay_us=1000, adaptive=True)
    assert next_batch(pending, T0 + 100 * US, r, arrival_gap_ns=1001 * US) == Send((0, 1))


def test_adaptive_delay_waits_like_triton_while_arrivals_are_close() -> None:
    pending = queue(1, 1)
    r = rules(delay_us=1000, adaptive=True)
    assert next_batch(pending, T0 + 100 * US, r, arrival_gap_ns=1000 * US) == Wait(900 * US)


def test_adaptive_delay_waits_until_the_arrival_gap_is_known() -> None:
    r = rules(delay_us=1000, adaptive=True)
    assert next_batch(queue(1), T0, r, arrival_gap_ns=None) == Wait(1000 * US)


def test_fixed_delay_waits_however_far_apart_arrivals_are() -> None:
    assert next_batch(queue(1), T0, rules(delay_us=1000), arrival_gap_ns=10**12) == Wait(1000 * US)


def test_adaptive_delay_still_sends_the_largest_preferred_size_only() -> None:
    pending = queue(2, 2, 1)
    r = rules(max_batch_size=8, delay_us=1000, preferred=[4, 8], adaptive=True)
    assert next_batch(pending, T0, r, arrival_gap_ns=10**12) == Send((0, 1))


def test_adaptive_delay_still_lets_a_full_later_group_go_first() -> None:
    pending = [Pending("b", 1, T0), Pending("a", 1, T0), Pending("a", 1, T0)]
    r = rules(max_batch_size=2, delay_us=1000, adaptive=True)
    assert next_batch(pending, T0, r, arrival_gap_ns=10**12) == Send((1, 2))


def test_adaptive_delay_sends_the_oldest_group_when_none_is_due() -> None:
    pending = [Pending("b", 1, T0), Pending("a", 1, T0 + US), Pending("b", 1, T0 + 2 * US)]
    r = rules(max_batch_size=4, delay_us=1000, adaptive=True)
    assert next_batch(pending, T0 + 10 * US, r, arrival_gap_ns=10**12) == Send((0, 2))


@given(scenarios(), st.one_of(st.none(), st.integers(0, 10**10)))
def test_adaptive_delay_only_ever_turns_a_wait_into_sending_what_is_pending(
    scenario: tuple[list[Pending], int, BatchRules], gap: int | None
) -> None:
    pending, now, r = scenario
    fixed = next_batch(pending, now, r, gap)
    adaptive = next_batch(pending, now, dataclasses.replace(r, adaptive_delay=True), gap)
    if isinstance(fixed, Send) or not pending:
        assert adaptive == fixed
    elif gap is not None and gap > r.max_queue_delay_ns:
        # the oldest group, in FIFO order, as much of it as fits
        assert isinstance(adaptive, Send)
        oldest = [i for i, p in enumerate(pending) if p.group == pending[0].group]
        assert adaptive.indices and list(adaptive.indices) == oldest[: len(adaptive.indices)]
        assert sum(pending[i].batch_size for i in adaptive.indices) <= r.max_batch_size
    else:
        assert adaptive == fixed


def test_arrival_gap_is_unknown_until_two_arrivals() -> None:
    gaps = ArrivalGap(cap_ns=10**9)
    assert gaps.mean_ns is None
    gaps.observe(T0)
    assert gaps.mean_ns is None
    gaps.observe(T0 + 300 * US)
    assert gaps.mean_ns == 300 * US


def test_arrival_gap_is_a_running_mean() -> None:
    gaps = ArrivalGap(cap_ns=10**9)
    for t in (0, 800, 1600):
        gaps.observe(T0 + t * US)
    gaps.observe(T0 + 1600 * US + 1600 * US)
    assert gaps.mean_ns == 800 * US + (1600 - 800) * US * ArrivalGap.WEIGHT


def test_arrival_gap_counts_an_arrival_out_of_order_as_no_gap() -> None:
    gaps = ArrivalGap(cap_ns=10**9)
    gaps.observe(T0 + 500 * US)
    gaps.observe(T0)  # stamped earlier by another gateway
    assert gaps.mean_ns == 0
    gaps.observe(T0 + 600 * US)  # measured from the latest arrival seen
    assert gaps.mean_ns == 100 * US * ArrivalGap.WEIGHT


def test_after_a_quiet_spell_a_short_burst_brings_the_mean_under_the_delay() -> None:
    delay = 1000 * US
    gaps = ArrivalGap(cap_ns=2 * delay)
    gaps.observe(T0)
    gaps.observe(T0 + 3600 * 10**9)  # an hour of silence counts as twice the delay
    assert gaps.mean_ns == 2 * delay
    t = T0 + 3600 * 10**9
    for _ in range(6):
        t += 50 * US
        gaps.observe(t)
    assert gaps.mean_ns is not None and gaps.mean_ns < delay


# --- running a batch on the worker's event loop ----------------------------------------------

#: one instance, nothing else pending, a 2 ms run, requests 3 ms apart.
IDLE = {"instance_count": 1, "others_pending": False, "last_run_ns": 2000 * US}


def test_a_lone_short_run_with_requests_further_apart_goes_on_the_loop() -> None:
    assert runs_inline(**IDLE, spacing_ns=3000 * US)


@pytest.mark.parametrize(
    "change",
    [
        {"instance_count": 2},  # another instance could run meanwhile: the loop must feed it
        {"others_pending": True},
        {"last_run_ns": None},  # how long a run takes is not known yet
        {"last_run_ns": INLINE_RUN_LIMIT_NS + 1, "spacing_ns": 10 * INLINE_RUN_LIMIT_NS},
        {"spacing_ns": None},
        {"spacing_ns": 2000 * US},  # a request would arrive while the run holds the loop
    ],
)
def test_anything_else_to_do_keeps_the_run_on_the_instance_thread(
    change: dict[str, object],
) -> None:
    assert not runs_inline(**{**IDLE, "spacing_ns": 3000 * US, **change})
