"""A decoupled request's responses at the gateway (gateway/response_order.py): delivered in
sequence order, each once, nothing after the final one."""

from __future__ import annotations

import pytest
from sluice.gateway.response_order import ResponseOrder
from sluice.shared.protocol import Result


def _response(seq: int, final: bool = False) -> Result:
    return Result("r", [], None, seq, final)


def _delivered(order: ResponseOrder) -> list[int]:
    taken = []
    while order.ready:
        seq = order.ready.popleft().seq
        assert seq is not None
        taken.append(seq)
    return taken


async def test_in_order_responses_are_delivered_as_they_come() -> None:
    order = ResponseOrder()
    order.receive(_response(0))
    assert order.wake.is_set() and _delivered(order) == [0]
    order.receive(_response(1))
    order.receive(_response(2, final=True))
    assert _delivered(order) == [1, 2] and order.finished


async def test_an_early_response_waits_for_the_ones_before_it() -> None:
    order = ResponseOrder()
    order.receive(_response(2))
    order.receive(_response(1))
    assert not order.wake.is_set() and _delivered(order) == []
    order.receive(_response(0))
    assert _delivered(order) == [0, 1, 2]


async def test_a_rerun_after_a_takeover_skips_what_was_delivered() -> None:
    """The new worker numbers from 0 again; 0-2 reached the client from the dead one."""
    order = ResponseOrder()
    for seq in range(3):
        order.receive(_response(seq))
    assert _delivered(order) == [0, 1, 2]
    for seq in range(5):
        order.receive(_response(seq, final=seq == 4))
    assert _delivered(order) == [3, 4] and order.finished


@pytest.mark.parametrize("late", [0, 1, 2, 3])
async def test_nothing_is_delivered_after_the_final_response(late: int) -> None:
    order = ResponseOrder()
    order.receive(_response(0))
    order.receive(_response(1, final=True))
    _delivered(order)
    order.receive(_response(late))
    assert _delivered(order) == [] and order.finished


async def test_an_ordinary_result_is_not_a_streamed_response() -> None:
    order = ResponseOrder()
    order.receive(Result("r"))
    assert _delivered(order) == [] and not order.wake.is_set()
