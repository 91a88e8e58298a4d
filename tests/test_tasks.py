"""stop_tasks: background loops end even when a cancellation is lost on the way."""

from __future__ import annotations

import asyncio

import pytest
from sluice.shared import tasks
from sluice.shared.tasks import stop_tasks


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
