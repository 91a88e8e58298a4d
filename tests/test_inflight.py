"""The in-flight scheduler: sequences leave and join between iterations, in the queue's order,
within the sequence and token limits."""

from __future__ import annotations

from sluice.workers.generation.inflight import InflightScheduler, Limits


def keys_of(sequences: list) -> list[str]:  # type: ignore[type-arg]
    return [s.key for s in sequences]


def test_finished_sequences_leave_and_waiting_ones_take_their_slots_at_once() -> None:
    scheduler: InflightScheduler[str] = InflightScheduler(Limits(max_sequences=2))
    for key in "abc":
        scheduler.submit(key, key)
    first = scheduler.next_iteration()
    assert (first.keep, keys_of(first.joining)) == ([], ["a", "b"])
    assert scheduler.room == 0
    scheduler.finish("a")
    second = scheduler.next_iteration()
    # the state keeps row 1 (b), c joins after it: the freed slot never stays empty
    assert (second.keep, keys_of(second.left), keys_of(second.joining)) == ([1], ["a"], ["c"])
    assert keys_of(scheduler.running) == ["b", "c"]


def test_an_iteration_without_change_keeps_every_row() -> None:
    scheduler: InflightScheduler[str] = InflightScheduler(Limits(max_sequences=4))
    scheduler.submit("a", "a")
    scheduler.next_iteration()
    unchanged = scheduler.next_iteration()
    assert (unchanged.keep, unchanged.changed) == ([0], False)


def test_higher_priority_levels_join_first_then_the_oldest() -> None:
    scheduler: InflightScheduler[str] = InflightScheduler(Limits(max_sequences=1))
    scheduler.submit("old-low", "x", level=2)
    scheduler.submit("new-low", "x", level=2)
    scheduler.submit("high", "x", level=1)
    order = []
    for _ in range(3):
        order += keys_of(scheduler.next_iteration().joining)
        scheduler.finish(scheduler.running[0].key)
    assert order == ["high", "old-low", "new-low"]


def test_a_running_sequence_is_never_paused_for_a_higher_priority_one() -> None:
    scheduler: InflightScheduler[str] = InflightScheduler(Limits(max_sequences=1))
    scheduler.submit("low", "x", level=2)
    scheduler.next_iteration()
    scheduler.submit("high", "x", level=1)
    step = scheduler.next_iteration()
    assert (step.keep, step.joining, keys_of(scheduler.running)) == ([0], [], ["low"])


def test_the_token_budget_counts_running_sequences_and_prompts() -> None:
    scheduler: InflightScheduler[str] = InflightScheduler(Limits(max_sequences=8, token_budget=10))
    scheduler.submit("a", "a", prompt_tokens=4)
    scheduler.submit("b", "b", prompt_tokens=5)
    scheduler.submit("c", "c", prompt_tokens=2)
    assert keys_of(scheduler.next_iteration().joining) == ["a", "b"]  # 9 tokens; with c 11
    # now the 2 running cost 2 tokens; c's prompt of 2 fits
    assert keys_of(scheduler.next_iteration().joining) == ["c"]


def test_a_prompt_over_the_budget_holds_the_younger_back_until_it_fits_alone() -> None:
    scheduler: InflightScheduler[str] = InflightScheduler(Limits(max_sequences=8, token_budget=6))
    scheduler.submit("running", "x", prompt_tokens=1)
    scheduler.next_iteration()
    scheduler.submit("big", "x", prompt_tokens=50)
    scheduler.submit("small", "x", prompt_tokens=1)
    assert scheduler.next_iteration().joining == []  # small does not overtake big
    scheduler.finish("running")
    step = scheduler.next_iteration()
    assert keys_of(step.joining) == ["big"]  # alone in an empty set, whatever its size
    assert keys_of(scheduler.next_iteration().joining) == ["small"]


def test_cancelled_sequences_leave_waiting_at_once_running_ones_before_the_next() -> None:
    scheduler: InflightScheduler[str] = InflightScheduler(Limits(max_sequences=1))
    scheduler.submit("a", "a")
    scheduler.submit("b", "b")
    scheduler.next_iteration()
    waiting = scheduler.cancel("b")
    assert waiting is not None and waiting.cancelled and scheduler.waiting == []
    assert scheduler.cancel("a") is None
    step = scheduler.next_iteration()
    assert [(s.key, s.cancelled) for s in step.left] == [("a", True)]
    assert scheduler.idle


def test_room_counts_the_slots_neither_running_nor_waiting_sequences_take() -> None:
    scheduler: InflightScheduler[str] = InflightScheduler(Limits(max_sequences=3))
    scheduler.submit("a", "a")
    scheduler.next_iteration()
    scheduler.submit("b", "b")
    assert scheduler.room == 1
    scheduler.finish("a")
    assert scheduler.room == 2  # a leaves before the next iteration


def test_a_failed_iteration_empties_the_running_set() -> None:
    scheduler: InflightScheduler[str] = InflightScheduler(Limits(max_sequences=2))
    scheduler.submit("a", "a")
    scheduler.submit("b", "b")
    scheduler.next_iteration()
    assert keys_of(scheduler.fail_running()) == ["a", "b"]
    assert scheduler.idle
