"""Triton's sequence batcher as a pure scheduler: slots, backlog, batches, ends and idle time."""

from __future__ import annotations

from sluice.workers.sequences.sequence_batcher import Member, Rules, SequenceBatcher, Slot

MS = 1_000_000


def _direct(instances: int = 1, slots: int = 2, idle_ms: int = 1000) -> SequenceBatcher[str]:
    return SequenceBatcher(Rules("direct", instances, slots, slots, idle_ms * MS))


def _items(batch: list[Member[str]] | int | None) -> list[str]:
    assert isinstance(batch, list)
    return [m.step.item for m in batch]


def test_a_request_that_starts_no_known_sequence_is_refused() -> None:
    batcher = _direct()
    assert not batcher.add(7, "a", start=False, end=False, now_ns=0)
    assert batcher.add(7, "b", start=True, end=False, now_ns=0)
    assert batcher.add(7, "c", start=False, end=False, now_ns=0)
    # 7 and "7" are two sequences
    assert not batcher.add("7", "d", start=False, end=False, now_ns=0)


def test_direct_batches_one_request_of_each_slot_in_slot_order() -> None:
    batcher = _direct(slots=2)
    batcher.add(1, "1a", True, False, 0)
    batcher.add(1, "1b", False, False, 0)
    batcher.add(2, "2a", True, False, 0)
    first = batcher.next_batch(0, 0)
    assert _items(first) == ["1a", "2a"]
    assert batcher.next_batch(0, 0) is None  # both sequences are running
    assert isinstance(first, list)
    batcher.finished(first, 0)
    assert _items(batcher.next_batch(0, 0)) == ["1b"]


def test_a_sequence_waits_in_the_backlog_until_an_end_frees_a_slot() -> None:
    batcher = _direct(slots=1)
    batcher.add(1, "1a", True, True, 0)
    batcher.add(2, "2a", True, False, 0)
    assert [s.key for s in batcher.backlog] == [2]
    batch = batcher.next_batch(0, 0)
    assert _items(batch) == ["1a"]
    assert isinstance(batch, list)
    ended = batcher.finished(batch, 0)
    assert [s.key for s in ended] == [1]
    assert batcher.slotted[Slot(0, 0)].key == 2
    assert _items(batcher.next_batch(0, 0)) == ["2a"]


def test_an_end_forgets_the_id_at_once_so_a_start_begins_a_new_sequence() -> None:
    batcher = _direct(slots=2)
    batcher.add(1, "1a", True, True, 0)
    assert not batcher.add(1, "late", False, False, 0)
    assert batcher.add(1, "again", True, False, 0)
    assert _items(batcher.next_batch(0, 0)) == ["1a", "again"]


def test_a_start_for_a_running_sequence_continues_it_in_its_slot() -> None:
    batcher = _direct(slots=2)
    batcher.add(1, "1a", True, False, 0)
    batcher.add(1, "1b", True, False, 0)
    assert len(batcher.slotted) == 1
    assert _items(batcher.next_batch(0, 0)) == ["1a"]


def test_an_idle_sequence_is_released_and_forgotten() -> None:
    batcher = _direct(slots=1, idle_ms=5)
    batcher.add(1, "1a", True, False, 0)
    batcher.add(2, "2a", True, False, 0)
    batch = batcher.next_batch(0, 0)
    assert isinstance(batch, list)
    batcher.finished(batch, 1 * MS)
    assert batcher.idle(5 * MS) == []  # 2 waits in the backlog with a request; 1 ran at 1 ms
    assert batcher.next_idle_ns() == 0 + 5 * MS
    released = batcher.idle(6 * MS)
    assert [s.key for s in released] == [1]
    assert not batcher.add(1, "1b", False, False, 6 * MS)
    assert _items(batcher.next_batch(0, 6 * MS)) == ["2a"]


def test_oldest_batches_the_oldest_sequences_up_to_max_batch_size() -> None:
    batcher: SequenceBatcher[str] = SequenceBatcher(Rules("oldest", 1, 8, 2, 1000 * MS))
    for key in (3, 1, 2):
        batcher.add(key, f"{key}a", True, False, 0)
    assert _items(batcher.next_batch(0, 0)) == ["3a", "1a"]


def test_oldest_waits_for_a_fuller_batch_up_to_its_delay() -> None:
    rules = Rules(
        "oldest", 1, 8, 4, 1000 * MS, delay_ns=10 * MS, preferred_batch_sizes=frozenset({3})
    )
    batcher: SequenceBatcher[str] = SequenceBatcher(rules)
    batcher.add(1, "1a", True, False, 0)
    assert batcher.next_batch(0, 4 * MS) == 6 * MS
    batcher.add(2, "2a", True, False, 4 * MS)
    batcher.add(3, "3a", True, False, 4 * MS)
    assert _items(batcher.next_batch(0, 5 * MS)) == ["1a", "2a", "3a"]  # a preferred size


def test_each_instance_runs_the_sequences_of_its_own_slots() -> None:
    batcher = _direct(instances=2, slots=1)
    batcher.add(1, "1a", True, False, 0)
    batcher.add(2, "2a", True, False, 0)
    assert _items(batcher.next_batch(1, 0)) == ["2a"]
    assert _items(batcher.next_batch(0, 0)) == ["1a"]


def test_a_dropped_sequence_leaves_its_slot_once_its_running_batch_finished() -> None:
    batcher = _direct(slots=1)
    batcher.add(1, "1a", True, False, 0)
    batcher.add(1, "1b", False, False, 0)
    batcher.add(2, "2a", True, False, 0)
    batch = batcher.next_batch(0, 0)
    assert isinstance(batch, list)
    assert [s.item for s in batcher.drop([batcher.slotted[Slot(0, 0)]])] == ["1b"]
    assert not batcher.add(1, "1c", False, False, 0)  # forgotten
    batcher.finished(batch, 0)
    assert _items(batcher.next_batch(0, 0)) == ["2a"]
