"""Backoff: the pauses every retry loop takes between failed attempts, longer after each
failure up to a cap, and from the first again after a success."""

from __future__ import annotations

import pytest
from sluice.gateway.outage import RETRY_CAP_S, RETRY_FIRST_S
from sluice.shared.backoff import Backoff
from sluice.shared.redis_client import UNREACHABLE_RETRY_DELAYS_S
from sluice.shared.supervision import RESTART_CAP_S, RESTART_FIRST_S
from sluice.workers.worker import RESUBSCRIBE_FIRST_S, RESUBSCRIBE_MAX_S


def _pauses_s(backoff: Backoff, failures: int) -> list[float]:
    return [backoff.next_s() for _ in range(failures)]


def test_doubling_pauses_stop_at_the_cap_and_repeat_it() -> None:
    backoff = Backoff.doubling(0.05, 0.5)
    assert _pauses_s(backoff, 7) == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5, 0.5]
    assert backoff.failures == 7


def test_a_table_of_pauses_repeats_its_last() -> None:
    backoff = Backoff((0.05, 0.1, 0.2, 0.5))
    assert _pauses_s(backoff, 6) == [0.05, 0.1, 0.2, 0.5, 0.5, 0.5]


def test_a_success_starts_the_pauses_over() -> None:
    backoff = Backoff.doubling(0.1, 5.0)
    assert _pauses_s(backoff, 3) == [0.1, 0.2, 0.4]
    backoff.reset()
    assert backoff.failures == 0
    assert _pauses_s(backoff, 2) == [0.1, 0.2]


def test_a_first_pause_past_the_cap_is_taken_once() -> None:
    assert _pauses_s(Backoff.doubling(3.0, 2.0), 3) == [3.0, 2.0, 2.0]


def test_no_pause_stays_no_pause() -> None:
    assert _pauses_s(Backoff.doubling(0.0, 1.0), 3) == [0.0, 0.0, 0.0]


def test_a_backoff_needs_a_pause() -> None:
    with pytest.raises(ValueError):
        Backoff(())


@pytest.mark.parametrize(
    ("backoff", "pauses_s"),
    [
        # the gateway's reconnects: outage, reply stream, job events
        (Backoff.doubling(RETRY_FIRST_S, RETRY_CAP_S), [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]),
        # a worker's reads and publishes
        (Backoff(UNREACHABLE_RETRY_DELAYS_S), [0.05, 0.1, 0.2, 0.5, 0.5, 0.5]),
        # a worker's cancellation channel
        (
            Backoff.doubling(RESUBSCRIBE_FIRST_S, RESUBSCRIBE_MAX_S),
            [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0],
        ),
        # a supervised background loop
        (Backoff.doubling(RESTART_FIRST_S, RESTART_CAP_S), [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0]),
    ],
)
def test_each_loop_keeps_its_pauses(backoff: Backoff, pauses_s: list[float]) -> None:
    assert _pauses_s(backoff, len(pauses_s)) == pauses_s
