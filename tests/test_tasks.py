"""stop_tasks: background loops end even when a cancellation is lost on the way; a Supervisor
runs a failed loop again, and reports it down until then."""

from __future__ import annotations

import asyncio
import logging

import pytest
from sluice.shared import tasks
from sluice.shared.supervision import Supervisor
from sluice.shared.tasks import stop_tasks

from tests.restart_gate import Gate


async def test_a_task_that_loses_its_cancellation_is_cancelled_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tasks, "RECANCEL_AFTER_S", 0.01)
    started, lost = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            lost.set()  # swallowed, as a client library can in a race
        await asyncio.Event().wait()  # and it runs on

    task = asyncio.create_task(stubborn())
    await started.wait()
    async with asyncio.timeout(30):  # a regression fails here instead of hanging the run
        await stop_tasks([task])
    assert lost.is_set()
    assert task.cancelled()


async def test_finished_and_plain_tasks_stop_at_once() -> None:
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    forever = asyncio.create_task(asyncio.Event().wait())
    await stop_tasks([done, forever])
    assert forever.cancelled()


async def test_a_failed_loop_is_logged_reported_down_and_run_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = Gate()
    supervisor = Supervisor(sleep=gate)
    runs, failures = [], []
    running_again = asyncio.Event()

    async def loop() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise RuntimeError("boom")
        running_again.set()
        await asyncio.Event().wait()

    supervisor.start("reader", loop, failures.append)
    await gate.asleep.wait()
    assert not supervisor.up and supervisor.down == {"reader"}
    assert [str(exc) for exc in failures] == ["boom"]
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "reader failed" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[1] is failures[0]  # the traceback
    gate.open()
    await running_again.wait()
    assert supervisor.up and runs == [0, 1]
    await supervisor.stop()


async def test_restarts_back_off_to_a_cap_and_start_over_after_a_long_run() -> None:
    now_s = [0.0]
    delays_s: list[float] = []

    async def sleep(delay_s: float) -> None:
        delays_s.append(delay_s)

    supervisor = Supervisor(first_s=0.1, cap_s=1.0, sleep=sleep, clock_s=lambda: now_s[0])
    runs = 0

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs == 7:
            now_s[0] += 1.0  # this run lasts as long as the longest wait: it was healthy
        if runs < 9:
            raise RuntimeError(f"failure {runs}")

    await supervisor.start("loop", loop)
    assert delays_s == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 0.1, 0.2]
    assert supervisor.up


async def test_a_loop_that_returns_or_is_cancelled_is_not_run_again() -> None:
    supervisor = Supervisor(sleep=Gate())
    finished = supervisor.start("once", lambda: asyncio.sleep(0))
    await finished
    forever = supervisor.start("forever", asyncio.Event().wait)
    await supervisor.stop()
    assert forever.cancelled() and supervisor.up
