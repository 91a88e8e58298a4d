"""Background loops that must not die quietly.

A gateway's reply reader or a worker queue's read loop rides out Redis errors itself; any other
exception used to end its task unseen, and the process went on reporting ready while nothing
read. Under a `Supervisor` such a failure is logged with its traceback, reported to whoever
waits on the loop, and the loop runs again after a backoff; the process reports not ready
(`up`) from the failure until the loop runs again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from sluice.shared.backoff import Backoff
from sluice.shared.tasks import stop_tasks

log = logging.getLogger(__name__)

#: the first wait before running a failed loop again; it doubles with each failure...
RESTART_FIRST_S = 0.1
#: ...up to this. A loop that ran this long before it failed starts from the first again.
RESTART_CAP_S = 5.0


def _no_one_waits(_: Exception) -> None:
    pass


class Supervisor:
    """Runs named background loops, each again after a backoff whenever it fails."""

    def __init__(
        self,
        first_s: float = RESTART_FIRST_S,
        cap_s: float = RESTART_CAP_S,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self._sleep = sleep
        self._clock_s = clock_s
        self._tasks: list[asyncio.Task[None]] = []
        self._down: set[str] = set()

    @property
    def up(self) -> bool:
        """No loop is waiting to run again after a failure."""
        return not self._down

    @property
    def down(self) -> frozenset[str]:
        return frozenset(self._down)

    def start(
        self,
        name: str,
        run: Callable[[], Awaitable[None]],
        on_failure: Callable[[Exception], None] = _no_one_waits,
    ) -> asyncio.Task[None]:
        """Run `run()` until it returns or is cancelled; each time it raises, `on_failure` gets
        the exception (to fail what waits on the loop) and `run()` is called again."""
        task = asyncio.create_task(self._supervise(name, run, on_failure), name=name)
        self._tasks.append(task)
        return task

    async def _supervise(
        self, name: str, run: Callable[[], Awaitable[None]], on_failure: Callable[[Exception], None]
    ) -> None:
        backoff = Backoff.doubling(self.first_s, self.cap_s)
        while True:
            started_s = self._clock_s()
            try:
                await run()
                return
            except Exception as exc:  # a cancellation is not a failure: it ends the loop
                failure = exc
            if self._clock_s() - started_s >= self.cap_s:
                backoff.reset()
            delay_s = backoff.next_s()
            self._down.add(name)
            log.error("%s failed; running it again in %.2f s", name, delay_s, exc_info=failure)
            try:
                on_failure(failure)
                await self._sleep(delay_s)
            finally:
                self._down.discard(name)

    async def stop(self) -> None:
        """Cancel every loop and wait until each has ended."""
        await stop_tasks(self._tasks)
