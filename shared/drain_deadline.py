"""A hard limit on a process's drain after a stop signal: graceful first, then out.

A drain waits on things that may never end: a model stuck in a batch, a Redis that does not
answer, a bulk job that feeds for an hour. An orchestrator's SIGKILL would end it, but no
process should count on one. The first stop signal starts a timer thread; if the drain is
still going when it fires, the thread logs what was pending and ends the process with
`os._exit`, whatever its event loop or its other threads are doing. A second signal ends it
at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_HELP = (
    "Seconds to finish the work in hand after SIGTERM/SIGINT; then the process exits whatever "
    "it still waits on (a second signal exits at once)."
)
#: the exit status of a process whose drain was cut short (deadline or second signal).
CUT_SHORT_STATUS = 1
#: how long a cut-short exit waits for its log line to be written.
REPORT_TIMEOUT_S = 1.0


class DrainDeadline:
    """`signal()` from a stop-signal handler: the first call starts the clock, the next exits.

    `pending` describes, for the log, what the drain still waits on; `before_exit` runs just
    before a cut-short exit (e.g. to SIGKILL the children of a supervisor). Both run on the
    timer thread or in the signal handler, so they must not wait on the event loop.
    """

    def __init__(
        self,
        timeout_s: float,
        what: str,
        pending: Callable[[], str] = lambda: "",
        before_exit: Callable[[], None] = lambda: None,
        exit_process: Callable[[int], NoReturn] = os._exit,
    ) -> None:
        self.timeout_s = timeout_s
        self.what = what
        self._pending = pending
        self._before_exit = before_exit
        self._exit = exit_process
        self._started = threading.Event()

    @property
    def started(self) -> bool:
        return self._started.is_set()

    def signal(self) -> None:
        """A stop signal arrived: start the drain's clock, or cut the drain short."""
        if self._started.is_set():
            self.cut_short("a second stop signal")
        self._started.set()
        threading.Thread(target=self._watch, name="drain-deadline", daemon=True).start()

    def _watch(self) -> None:
        time.sleep(self.timeout_s)
        self.cut_short(f"the drain timeout ({self.timeout_s:g} s)")

    def cut_short(self, reason: str) -> NoReturn:
        try:
            self._before_exit()
        finally:
            # the report goes on a thread of its own: a log handler whose lock a stuck thread
            # holds (a full pipe) must not keep the process alive
            report = threading.Thread(target=self._report, args=(reason,), daemon=True)
            report.start()
            report.join(REPORT_TIMEOUT_S)
            self._exit(CUT_SHORT_STATUS)

    def _report(self, reason: str) -> None:
        try:
            pending = self._pending()
        except Exception as exc:  # the exit must happen whatever the description does
            pending = f"unknown ({exc!r})"
        detail = f"; still pending: {pending}" if pending else ""
        log.error("%s exits after %s%s", self.what, reason, detail)


def on_stop_signals(
    deadline: DrainDeadline, loop: asyncio.AbstractEventLoop, stop: Callable[[], None]
) -> None:
    """SIGTERM/SIGINT start `deadline` and run `stop` on `loop`.

    Plain signal handlers rather than the loop's: Python runs them on the main thread
    between bytecodes, and Linux wakes a sleeping main thread for them, so the deadline
    starts even while a model holds the loop's thread, where a loop handler would wait.
    """

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        deadline.signal()
        loop.call_soon_threadsafe(stop)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
