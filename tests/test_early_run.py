"""A lone batch run while its delay runs out: it answers its batch only if the batcher, once
the delay is out, takes exactly those requests; otherwise it is dropped and the batch runs as
usual. Batches are never formed differently."""

from __future__ import annotations

import asyncio
import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from sluice.shared.model_config import ModelSpec
from sluice.shared.stats import BatchStats
from sluice.workers.batching.batch_loop import BatchLoop
from sluice.workers.batching.batcher import BatchRules, Send
from sluice.workers.batching.early_run import EarlyRuns
from sluice.workers.batching.queue_state import QueueState
from sluice.workers.instances.lanes import Instances
from sluice.workers.instances.stacked import StackedInstance

from tests.batch_loop_harness import Launches, add_model, queued
from tests.streams import int_request

MS = 1_000_000
#: a minute: the loop's clock is the test's, so no real wait comes to its end.
DELAY_NS = 60_000 * MS
RULES = BatchRules(
    max_batch_size=4, dynamic=True, max_queue_delay_ns=DELAY_NS, preferred_batch_sizes=frozenset()
)
#: long enough that only a missing release lets a gated run go on.
WAIT_S = 60.0
CPU = torch.device("cpu")


@pytest.fixture
def spec(tmp_path: Path) -> ModelSpec:
    return add_model(tmp_path)


class Gated:
    """One lane whose runs each wait for a release; every run's rows are kept."""

    def __init__(self, spec: ModelSpec) -> None:
        self.called = threading.Semaphore(0)
        self.release = threading.Semaphore(0)
        self.seen: list[list[int]] = []
        self.instances = Instances(spec, {1: [StackedInstance(spec, self._infer, CPU)]}, CPU)
        self.instances.last_run_ns = MS  # a run takes about a millisecond

    def _infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        self.seen.append(inputs["IN"].reshape(-1).tolist())
        self.called.release()
        assert self.release.acquire(timeout=WAIT_S)
        return {"OUT": inputs["IN"] + 1}

    async def next_call(self) -> None:
        assert await asyncio.to_thread(self.called.acquire, True, WAIT_S)


def test_the_batch_the_delay_releases_is_the_one_decide_takes_then() -> None:
    state = QueueState(RULES, 1, 1)
    assert state.batch_when_due() == []
    for i in range(5):
        queued(state, int_request(i, "reply"), i)
    assert [q.request.id for q in state.batch_when_due()] == ["r0", "r1", "r2", "r3"]
    assert len(state.pending) == 5  # nothing taken


def _waits(early: EarlyRuns, state: QueueState, joined: bool) -> None:
    """One partial batch waits (r0 alone) and is formed, with r1 joining it or not."""
    queued(state, int_request(0, "reply"), 0)
    early.waiting()
    if joined:
        queued(state, int_request(1, "reply"), 1)
    decision = state.decide(now_ns=DELAY_NS)
    assert isinstance(decision, Send)
    early.claim(state.batch_launched(decision.indices, MS).batch)
    state.batch_finished(0)


def test_early_runs_start_only_after_waits_that_no_request_joined(spec: ModelSpec) -> None:
    gated = Gated(spec)
    state = QueueState(RULES, 1, 1)
    early = EarlyRuns(state, gated.instances, enabled=True)
    for _ in range(EarlyRuns.QUIET_WAITS):
        assert not early.worth_starting()
        _waits(early, state, joined=False)
    assert early.worth_starting()
    gated.instances.last_run_ns = None  # this once nothing is run early, but it is watched
    _waits(early, state, joined=True)
    gated.instances.last_run_ns = MS
    assert not early.worth_starting()
    for _ in range(EarlyRuns.QUIET_WAITS - 1):
        _waits(early, state, joined=False)
    assert not early.worth_starting()  # after a join, as many quiet waits again
    _waits(early, state, joined=False)
    assert early.worth_starting()
    assert not EarlyRuns(state, gated.instances, enabled=False).worth_starting()
    gated.instances.last_run_ns = None  # the model's runs are not timed (a Python model)
    assert not early.worth_starting()
    assert gated.seen == []  # nothing was run early meanwhile
    gated.instances.shutdown()


class Clock:
    """The batch loop's wall clock, moved by the test only."""

    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns


def _served(spec: ModelSpec, then: Any, joining: int) -> tuple[Launches, EarlyRuns, Gated]:
    """r0 arrives alone after waits that none joined, and its run starts at once; `then(state,
    gated)` runs while that run is held, the delay runs out, and the loop answers until r0 and
    the `joining` requests are."""

    async def run() -> tuple[Launches, EarlyRuns, Gated]:
        gated = Gated(spec)
        state = QueueState(RULES, 1, 1)
        launches = Launches(state, gated.instances)
        early = EarlyRuns(state, gated.instances, enabled=True)
        early.quiet = EarlyRuns.QUIET_WAITS  # no request joined the waits before
        clock = Clock()
        batching = BatchLoop(state, gated.instances, None, launches, early, clock)  # type: ignore[arg-type]
        loop = asyncio.create_task(batching.run())
        queued(state, int_request(0, "reply"), 0)
        await gated.next_call()
        assert launches.answers == [] and len(state.pending) == 1  # run, but not yet a batch
        await then(state, gated)
        clock.now_ns = 2 * DELAY_NS  # every delay is out when the early run ends and wakes the loop
        gated.release.release()
        while sum(map(len, launches.answers)) < 1 + joining:
            launches.answered.clear()
            await launches.answered.wait()
        state.stop_requested()
        await loop
        gated.instances.shutdown()
        return launches, early, gated

    return asyncio.run(run())


def test_a_lone_request_is_answered_by_the_run_made_while_its_delay_ran_out(
    spec: ModelSpec,
) -> None:
    async def nothing(state: QueueState, gated: Gated) -> None:
        return None

    launches, early, gated = _served(spec, nothing, joining=0)
    assert launches.answers == [[1]] and launches.early == [True]
    assert gated.seen == [[0]]  # one run only
    assert (early.used, early.dropped) == (1, 0)


def test_a_request_joining_during_the_delay_drops_the_early_run(spec: ModelSpec) -> None:
    async def another_joins(state: QueueState, gated: Gated) -> None:
        queued(state, int_request(1, "reply"), 1)
        gated.release.release()  # the batch r0 + r1 runs after the early run

    launches, early, gated = _served(spec, another_joins, joining=1)
    assert launches.answers == [[1, 2]] and launches.early == [False]
    assert gated.seen == [[0], [0, 1]]
    assert (early.used, early.dropped) == (0, 1)


def test_a_request_leaving_during_the_delay_drops_the_early_run(spec: ModelSpec) -> None:
    async def it_leaves_and_another_comes(state: QueueState, gated: Gated) -> None:
        assert state.request_cancelled("r0") is not None
        queued(state, int_request(1, "reply"), 1)
        gated.release.release()

    launches, early, gated = _served(spec, it_leaves_and_another_comes, joining=0)
    assert launches.answers == [[2]] and launches.early == [False]
    assert gated.seen == [[0], [1]]
    assert (early.used, early.dropped) == (0, 1)


def test_a_failing_early_run_fails_only_its_batch_and_a_dropped_one_nobody(
    spec: ModelSpec,
) -> None:
    def broken(inputs: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("out of memory")

    async def run() -> tuple[list[Any], list[dict[str, Any]]]:
        loop_errors: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
        instances = Instances(spec, {1: [StackedInstance(spec, broken, CPU)]}, CPU)
        instances.last_run_ns = MS
        state = QueueState(RULES, 1, 1)
        early = EarlyRuns(state, instances, enabled=True)
        early.quiet = EarlyRuns.QUIET_WAITS
        # claimed: the batch is answered with the model's error, as a batch run late would be
        queued(state, int_request(0, "reply"), 0)
        state.wake.clear()
        early.waiting()
        await state.wake.wait()  # the run failed and gave its lane back
        launch = state.batch_launched((0,), MS)
        held, dropped = early.claim(launch.batch)
        assert held is not None and not dropped
        stats = BatchStats(1, 1, 0)
        results = await instances.run_isolating(
            launch.lane, [q.request for q in launch.batch], [1], stats, held.running
        )
        state.batch_finished(launch.lane)
        # dropped: its failure goes nowhere
        queued(state, int_request(1, "reply"), 1)
        early.waiting()
        queued(state, int_request(2, "reply"), 2)
        state.wake.clear()
        await state.wake.wait()
        assert early.claim(state.batch_launched((0, 1), MS).batch) == (None, True)
        del held
        gc.collect()
        instances.shutdown()
        return results, loop_errors

    results, loop_errors = asyncio.run(run())
    assert [r.id for r in results] == ["r0"]
    assert results[0].error is not None and "out of memory" in results[0].error[1]
    assert loop_errors == []
