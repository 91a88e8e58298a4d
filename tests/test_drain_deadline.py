"""The drain deadline: a second signal or the timer ends the process, saying what was left."""

from __future__ import annotations

import logging
import threading
from typing import NoReturn

import pytest
from sluice.shared.drain_deadline import CUT_SHORT_STATUS, DrainDeadline


class Exited(Exception):
    pass


def _exit(status: int) -> NoReturn:
    raise Exited(status)


def test_a_second_signal_exits_at_once_after_the_hook(caplog: pytest.LogCaptureFixture) -> None:
    hooked: list[bool] = []
    deadline = DrainDeadline(
        3600, "worker w1", lambda: "2 batches", lambda: hooked.append(True), _exit
    )
    deadline.signal()
    assert deadline.started and not hooked
    with pytest.raises(Exited) as exited:
        deadline.signal()
    assert exited.value.args == (CUT_SHORT_STATUS,)
    assert hooked == [True]
    assert "worker w1 exits after a second stop signal; still pending: 2 batches" in caplog.text


def test_the_timer_exits_even_when_describing_what_is_pending_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exits: list[int] = []
    done = threading.Event()

    def record_exit(status: int) -> NoReturn:
        exits.append(status)
        done.set()
        threading.Event().wait()  # the daemon timer thread stays here, as if the process ended
        raise AssertionError("unreachable")

    def broken() -> str:
        raise RuntimeError("no state")

    caplog.set_level(logging.ERROR)
    DrainDeadline(0, "gateway", broken, exit_process=record_exit).signal()
    assert done.wait(30)
    assert exits == [CUT_SHORT_STATUS]
    assert "gateway exits after the drain timeout (0 s); still pending: unknown" in caplog.text
