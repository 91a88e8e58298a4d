"""The next batch's inputs made while every lane is busy: used by the lane only when it takes
exactly the batch they were made for, so no batch changes. The decision and the hand-over run on
the CPU (`stage_ahead=True`); on a GPU the same path copies on a stream of its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import Tensor
from sluice.workers.batching.batch_loop import BatchLoop
from sluice.workers.batching.batcher import BatchRules, Send
from sluice.workers.batching.early_run import EarlyRuns
from sluice.workers.batching.queue_state import QueueState
from sluice.workers.devices.stage_ahead import StageAhead
from sluice.workers.instances.lanes import Instances
from sluice.workers.instances.stacked import StackedInstance

from tests.batch_loop_harness import Launches, add_model, queued, values
from tests.streams import int_request

MS = 1_000_000
RULES = BatchRules(
    max_batch_size=4, dynamic=True, max_queue_delay_ns=10 * MS, preferred_batch_sizes=frozenset()
)
#: long enough that only a missing release lets a gated run go on.
WAIT_S = 60.0
CPU = torch.device("cpu")


@pytest.fixture
def spec(tmp_path: Path) -> ModelSpec:
    return add_model(tmp_path)


def test_staged_inputs_are_those_the_lane_would_stack(spec: ModelSpec) -> None:
    ahead = StageAhead(spec, torch.device("cpu"))
    batch = [int_request(i, "reply") for i in range(4)]
    ahead.stage(batch)
    staged = ahead.take(batch)
    assert staged is not None and ahead.used == 1
    assert staged.inputs["IN"].tolist() == [[0], [1], [2], [3]]  # type: ignore[attr-defined]
    assert ahead.take(batch) is None  # taken once


def test_staging_the_same_batch_again_drops_nothing(spec: ModelSpec) -> None:
    ahead = StageAhead(spec, torch.device("cpu"))
    batch = [int_request(i, "reply") for i in range(4)]
    ahead.stage(batch)
    ahead.stage(list(batch))
    assert ahead.dropped == 0 and ahead.take(batch) is not None


def test_a_lane_taking_other_requests_drops_the_staged_inputs(spec: ModelSpec) -> None:
    ahead = StageAhead(spec, torch.device("cpu"))
    batch = [int_request(i, "reply") for i in range(4)]
    ahead.stage(batch)
    assert ahead.take(batch[1:]) is None
    assert ahead.dropped == 1 and ahead.take(batch) is None


def test_inputs_that_do_not_stack_are_left_to_the_lane(spec: ModelSpec) -> None:
    ahead = StageAhead(spec, torch.device("cpu"))
    odd = int_request(9, "reply")
    odd.inputs[0] = Tensor("IN", "INT64", (1, 2), bytes(16))
    batch = [int_request(0, "reply"), odd]
    ahead.stage(batch)
    assert ahead.take(batch) is None and ahead.used == 0


def test_only_a_full_batch_is_staged_while_the_lanes_are_busy() -> None:
    state = QueueState(RULES, 1, 1)
    queued(state, int_request(0, "reply"), 0)
    state.batch_launched((0,), last_run_ns=None)
    for i in range(1, 4):
        queued(state, int_request(i, "reply"), i)
    assert state.full_batch(now_ns=20 * MS) == []  # due, but one more could still join it
    queued(state, int_request(4, "reply"), 4)
    queued(state, int_request(5, "reply"), 5)
    full = state.full_batch(now_ns=5)
    assert [q.request.id for q in full] == ["r1", "r2", "r3", "r4"]
    assert len(state.pending) == 5  # nothing taken


def _gated(
    spec: ModelSpec, called: threading.Event | None = None
) -> tuple[Instances, threading.Event, list[Any]]:
    """One lane whose first run (`called` once it started) waits for the release; every
    run's input is kept."""
    release, seen = threading.Event(), []

    def infer(inputs: dict[str, Any]) -> dict[str, Any]:
        seen.append(inputs["IN"])
        if len(seen) == 1:
            if called is not None:
                called.set()
            release.wait(WAIT_S)
        return {"OUT": inputs["IN"] + 1}

    lanes = {1: [StackedInstance(spec, infer, CPU)]}
    return Instances(spec, lanes, CPU, stage_ahead=True), release, seen


def _second_batch(
    spec: ModelSpec, arrivals: int, before_the_lane_frees: Callable[[QueueState], object]
) -> tuple[list[int], StageAhead, list[Any]]:
    """r0 runs alone; r1.. arrive while it runs and the full batch is staged ahead; then
    `before_the_lane_frees`, and the lane takes the next batch as the batch loop would: its
    answers, the staging and every run's input."""

    async def run() -> tuple[list[int], StageAhead, list[Any]]:
        instances, release, seen = _gated(spec)
        assert instances.ahead is not None
        state = QueueState(RULES, 1, 1)
        queued(state, int_request(0, "reply"), 0)
        launch = state.batch_launched((0,), last_run_ns=None)
        first = instances.start(launch.lane, [q.request for q in launch.batch], [1])
        for i in range(1, arrivals + 1):
            queued(state, int_request(i, "reply"), i)
        instances.ahead.stage([q.request for q in state.full_batch(now_ns=arrivals)])
        before_the_lane_frees(state)
        release.set()
        assert values((await first)[0]) == [1]
        state.batch_finished(launch.lane)
        decision = state.decide(now_ns=arrivals + 1)
        assert isinstance(decision, Send)
        launch = state.batch_launched(decision.indices, last_run_ns=None)
        outputs, _ = await instances.start(launch.lane, [q.request for q in launch.batch], [1] * 4)
        instances.shutdown()
        return values(outputs), instances.ahead, seen

    return asyncio.run(run())


def test_the_lane_runs_the_full_batch_on_the_inputs_staged_for_it(spec: ModelSpec) -> None:
    answers, ahead, seen = _second_batch(spec, 4, lambda state: None)
    assert answers == [2, 3, 4, 5]
    assert (ahead.used, ahead.dropped) == (1, 0)
    assert seen[1].tolist() == [[1], [2], [3], [4]]


def test_a_batch_changed_after_staging_is_stacked_afresh(spec: ModelSpec) -> None:
    # r2's client leaves: the next batch is r1, r3, r4, r5
    answers, ahead, seen = _second_batch(spec, 5, lambda state: state.request_cancelled("r2"))
    assert answers == [2, 4, 5, 6]
    assert (ahead.used, ahead.dropped) == (0, 1)
    assert seen[1].tolist() == [[1], [3], [4], [5]]


def test_a_cpu_model_stages_nothing_by_default(spec: ModelSpec) -> None:
    instances = Instances(spec, {1: [StackedInstance(spec, lambda inputs: inputs, CPU)]}, CPU)
    assert instances.ahead is None
    instances.shutdown()


def test_the_batch_loop_stages_the_full_batch_while_its_lane_is_busy(spec: ModelSpec) -> None:
    async def run() -> None:
        called = threading.Event()
        instances, release, seen = _gated(spec, called)
        ahead = instances.ahead
        assert ahead is not None
        staged = asyncio.Event()
        stage = ahead.stage

        def staging(requests: Any) -> None:
            stage(requests)
            staged.set()

        ahead.stage = staging  # type: ignore[method-assign]
        state = QueueState(RULES, 1, 1)
        launches = Launches(state, instances)
        early = EarlyRuns(state, instances, enabled=False)
        loop = asyncio.create_task(BatchLoop(state, instances, None, launches, early).run())  # type: ignore[arg-type]
        queued(state, int_request(0, "reply"), 0)  # runs alone, held by the gate
        assert await asyncio.to_thread(called.wait, WAIT_S)
        for i in range(1, 5):
            queued(state, int_request(i, "reply"), i)
        await asyncio.wait_for(staged.wait(), WAIT_S)
        release.set()
        while len(launches.answers) < 2:
            launches.answered.clear()
            await launches.answered.wait()
        state.stop_requested()
        await loop
        instances.shutdown()
        assert launches.answers == [[1], [2, 3, 4, 5]]
        assert (ahead.used, ahead.dropped) == (1, 0)
        assert seen[1].tolist() == [[1], [2], [3], [4]]

    asyncio.run(run())
