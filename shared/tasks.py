"""Stopping background tasks that run Redis commands."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

#: how long to wait for cancelled tasks before cancelling the stragglers again.
RECANCEL_AFTER_S = 1.0


async def stop_tasks(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` and wait until every one has ended.

    redis-py can lose a cancellation that lands in the middle of a command
    (redis/redis-py#2028, #2551); a loop that missed it would run on and keep its process
    from exiting, so stragglers are cancelled again until they end.
    """
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_AFTER_S)
