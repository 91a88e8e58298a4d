"""Poll for the next event instead of sleeping, for a short while after work at low load.

A lone request hands off six times between processes (client, gateway, Redis, worker, Redis,
gateway, client). Where an idle CPU halts and waking it is slow (a VM whose guest halt polling
is off; `perf sched` figures in benchmarks/RESULTS.md), those wakes are a large part of its
latency. Keeping the event loop turning for a short while after work keeps this process's CPU
awake for the next message, as the kernel's guest halt polling and Seastar's idle polling do.
Each turn yields the CPU, so a task waiting for the same CPU runs first. The owner arms it
only when nothing else is coming its way (one request in flight at a gateway, a batch run on a
worker's loop), so under load it never turns.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

#: how long a gateway or worker keeps polling after work at low load (CLI: --idle-poll-us).
DEFAULT_WINDOW_US = 2000


class IdlePoll:
    """Keeps one event loop turning until `window_ns` after the latest `arm()`."""

    def __init__(
        self,
        window_ns: int,
        may_poll: Callable[[], bool],
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        pause: Callable[[], None] = os.sched_yield,
    ) -> None:
        self.window_ns = window_ns
        self._may_poll = may_poll
        self._clock_ns = clock_ns
        self._pause = pause
        self._until_ns = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        #: a turn is scheduled on the loop.
        self.polling = False

    def arm(self) -> None:
        """Poll until the window after now has passed, or `may_poll()` turns false."""
        if not self.window_ns or not self._may_poll():
            return  # under load: not even one turn
        self._until_ns = self._clock_ns() + self.window_ns
        if not self.polling:
            self.polling = True
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._turn)

    def stop(self) -> None:
        """End the window now (the owner is closing)."""
        self._until_ns = 0

    def _turn(self) -> None:
        # a callback always ready keeps the loop polling its sockets without blocking
        if self._clock_ns() < self._until_ns and self._may_poll():
            self._pause()
            assert self._loop is not None
            self._loop.call_soon(self._turn)
        else:
            self.polling = False
