"""A model queue's state and its transitions, without Redis, threads or a clock of its own:
every time is the test's, handed to the transition that needs it."""

from __future__ import annotations

import itertools

from sluice.shared.protocol import Request
from sluice.workers.batching.batcher import INLINE_RUN_LIMIT_NS, BatchRules, Pending, Send, Wait
from sluice.workers.batching.pending import Queued
from sluice.workers.batching.queue_state import QueueState

MS = 1_000_000
RULES = BatchRules(
    max_batch_size=4, dynamic=True, max_queue_delay_ns=10 * MS, preferred_batch_sizes=frozenset()
)
_ids = itertools.count()


def state(instances: int = 1, levels: int = 1, rules: BatchRules = RULES) -> QueueState:
    return QueueState(rules, instances, levels)


def read(s: QueueState, at_ns: int, size: int = 1, **deadlines: int) -> Queued:
    """A request read at `at_ns`, queued as the reader would, the reply settled."""
    request = Request(f"r{next(_ids)}", 1, at_ns, "reply", [])
    item = Queued(request, "s", b"1-0", Pending(1, size, at_ns), seq=next(_ids), **deadlines)
    s.arrived(at_ns)
    s.queued(item)
    s.requests_read()
    return item


def test_a_fresh_queue_may_read_and_has_nothing_to_launch() -> None:
    s = state()
    assert s.may_read and s.room.is_set()
    assert s.idle and not s.in_hand and not s.may_launch and not s.finished


def test_reading_stops_at_a_batch_in_hand() -> None:
    s = state()
    read(s, 0, size=3)
    assert s.room.is_set() and s.wake.is_set()
    read(s, 1, size=1)
    assert not s.may_read and not s.room.is_set()
    assert s.may_launch


def test_a_fifo_model_reads_ahead_while_its_instance_runs() -> None:
    s = state(levels=1)
    read(s, 0)
    s.batch_launched((0,), last_run_ns=None)
    assert s.busy_lanes == 1 and not s.may_launch
    assert s.may_read and s.room.is_set()  # the next batch is read while this one runs


def test_a_model_with_priority_levels_reads_only_while_an_instance_is_free() -> None:
    s = state(levels=2)
    read(s, 0)
    s.batch_launched((0,), last_run_ns=None)
    assert not s.may_read and not s.room.is_set()
    s.batch_finished(0)
    assert s.may_read and s.room.is_set() and s.wake.is_set()


def test_a_freed_lane_asks_for_one_catch_up_read_of_what_fits_a_batch() -> None:
    s = state(levels=2)
    read(s, 0)
    s.batch_launched((0,), last_run_ns=None)
    read(s, 1)  # handed over by the blocking read while the lane was busy
    s.batch_finished(0)
    assert s.catch_up_count() == RULES.max_batch_size - 1
    assert s.catch_up_count() == 0  # once per freed lane


def test_a_fifo_model_has_read_ahead_and_needs_no_catch_up() -> None:
    s = state(levels=1)
    read(s, 0)
    s.batch_launched((0,), last_run_ns=None)
    read(s, 1)
    s.batch_finished(0)
    assert s.catch_up_count() == 0


def test_no_catch_up_without_a_dynamic_batcher_or_with_nothing_in_hand() -> None:
    static = state(levels=2, rules=BatchRules(4, False, 0, frozenset()))
    read(static, 0)
    static.batch_launched((0,), last_run_ns=None)
    read(static, 1)
    static.batch_finished(0)
    assert static.catch_up_count() == 0
    empty = state(levels=2)
    read(empty, 0)
    empty.batch_launched((0,), last_run_ns=None)
    empty.batch_finished(0)
    assert empty.catch_up_count() == 0


def test_the_decision_waits_for_the_delay_then_sends() -> None:
    s = state()
    read(s, 100 * MS)
    assert s.decide(100 * MS) == Wait(10 * MS)
    assert s.decide(104 * MS) == Wait(6 * MS)
    assert s.decide(110 * MS) == Send((0,))


def test_the_wait_ends_at_the_next_timeout() -> None:
    s = state()
    read(s, 100 * MS, timeout_at_ns=103 * MS)
    assert s.decide(101 * MS) == Wait(2 * MS)


def test_expiry_removes_late_requests_and_makes_room() -> None:
    s = state()
    read(s, 0, size=3, deadline_at_ns=5 * MS)
    read(s, 1, size=1)
    assert not s.room.is_set()
    expired = s.expired(5 * MS)
    assert [reason for _, _, reason in expired] == ["REJECTED"]
    assert len(s.pending) == 1 and s.room.is_set()


def test_a_lone_short_run_goes_on_the_loop_and_nothing_is_read_until_it_is_answered() -> None:
    s = state(instances=1)
    read(s, 0)
    read(s, 20 * MS)  # arrivals far apart
    s.batch_launched((0,), last_run_ns=None)  # the first run: its time is not known yet
    s.batch_finished(0)
    launch = s.batch_launched((0,), last_run_ns=INLINE_RUN_LIMIT_NS // 5)
    assert launch.inline and s.answering_inline
    assert not s.may_read and not s.room.is_set()
    s.inline_answered(launch.lane)
    assert not s.answering_inline and s.may_read and s.room.is_set() and s.idle


def test_a_run_goes_to_its_thread_while_others_wait_or_with_two_instances() -> None:
    busy = state(instances=1)
    read(busy, 0)
    read(busy, 20 * MS)
    read(busy, 40 * MS, size=3)
    assert not busy.batch_launched((0,), last_run_ns=MS).inline  # others still pending
    two = state(instances=2)
    read(two, 0)
    read(two, 20 * MS)
    assert not two.batch_launched((0,), last_run_ns=MS).inline


def test_stopping_wakes_both_loops_reads_nothing_and_sends_what_is_in_hand() -> None:
    s = state()
    read(s, 0, size=4)
    s.wake.clear()
    assert not s.room.is_set()
    s.stop_requested()
    assert s.room.is_set() and s.wake.is_set()  # the reader wakes to see it is stopping
    assert not s.may_read and not s.finished
    assert s.decide(0) == Send((0,))  # no waiting for the delay
    s.batch_launched((0,), last_run_ns=None)
    assert s.finished and s.room.is_set()


def test_a_cancelled_request_leaves_the_queue_and_frees_its_room() -> None:
    s = state()
    item = read(s, 0, size=4)
    assert not s.room.is_set()
    assert s.request_cancelled(item.request.id) is item
    assert s.room.is_set() and not s.pending
    assert s.request_cancelled(item.request.id) is None


def test_published_results_count_batches() -> None:
    s = state()
    s.results_published()
    s.results_published()
    assert s.batches_done == 2
