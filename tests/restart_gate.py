"""A Supervisor's sleep that the test opens: a failed loop stays down until then."""

from __future__ import annotations

import asyncio


class Gate:
    def __init__(self) -> None:
        self.delays: list[float] = []
        self.asleep = asyncio.Event()
        self._open = asyncio.Event()

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        self.asleep.set()
        await self._open.wait()
        self._open.clear()
        self.asleep.clear()

    def open(self) -> None:
        self._open.set()
