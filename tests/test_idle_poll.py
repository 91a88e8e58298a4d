"""Idle polling: the loop keeps turning for the window after the latest arm, while allowed,
and other callbacks still run meanwhile. The clock is the test's: each turn advances it."""

from __future__ import annotations

import asyncio

from sluice.shared.idle_poll import IdlePoll


class TurnClock:
    """A clock that moves `step_ns` at every turn's pause, and counts the turns."""

    def __init__(self, step_ns: int = 100) -> None:
        self.now_ns = 0
        self.step_ns = step_ns
        self.turns = 0

    def __call__(self) -> int:
        return self.now_ns

    def pause(self) -> None:
        self.turns += 1
        self.now_ns += self.step_ns


async def until_still(poll: IdlePoll) -> None:
    while poll.polling:
        await asyncio.sleep(0)


async def test_turns_until_the_window_has_passed() -> None:
    clock = TurnClock(step_ns=100)
    poll = IdlePoll(1_000, lambda: True, clock, clock.pause)
    poll.arm()
    assert poll.polling
    await until_still(poll)
    assert clock.turns == 10


async def test_arming_again_extends_the_window_from_now() -> None:
    clock = TurnClock(step_ns=100)
    poll = IdlePoll(1_000, lambda: True, clock, clock.pause)
    poll.arm()
    while clock.turns < 5:
        await asyncio.sleep(0)
    poll.arm()
    await until_still(poll)
    assert clock.turns == 15


async def test_stops_as_soon_as_polling_is_no_longer_allowed() -> None:
    clock = TurnClock()
    allowed = [True]
    poll = IdlePoll(10**9, lambda: allowed[0], clock, clock.pause)
    poll.arm()
    while clock.turns < 3:
        await asyncio.sleep(0)
    allowed[0] = False
    await until_still(poll)
    assert clock.turns == 3


async def test_a_zero_window_never_polls() -> None:
    clock = TurnClock()
    poll = IdlePoll(0, lambda: True, clock, clock.pause)
    poll.arm()
    assert not poll.polling
    await asyncio.sleep(0)
    assert clock.turns == 0


async def test_other_work_runs_while_it_polls() -> None:
    clock = TurnClock(step_ns=1)
    allowed = [True]
    poll = IdlePoll(10**9, lambda: allowed[0], clock, clock.pause)

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readline())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
    poll.arm()
    writer.write(b"ping\n")
    assert await reader.readline() == b"ping\n"
    assert poll.polling and clock.turns > 0
    allowed[0] = False
    await until_still(poll)
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()


async def test_stop_ends_the_window_at_the_next_turn() -> None:
    clock = TurnClock()
    poll = IdlePoll(10**9, lambda: True, clock, clock.pause)
    poll.arm()
    await asyncio.sleep(0)
    poll.stop()
    await until_still(poll)
    assert clock.turns == 1


async def test_arming_while_polling_is_not_allowed_schedules_nothing() -> None:
    clock = TurnClock()
    poll = IdlePoll(10**9, lambda: False, clock, clock.pause)
    poll.arm()
    assert not poll.polling
