"""Triton's `dynamic_batching { preserve_ordering: true }` at the gateway: a model's results
are released in the order its requests came in, each after every earlier one was answered (or
failed), whichever worker ran it and however its batch was formed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class ReleaseOrder:
    """Per model, the release of the latest request through this gateway."""

    def __init__(self) -> None:
        self._last_released: dict[str, asyncio.Future[None]] = {}

    async def released(self, model: str, answer: Awaitable[T]) -> T:
        """`answer`'s outcome, once every earlier request to `model` had its own."""
        earlier = self._last_released.get(model)
        released: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last_released[model] = released
        try:
            result = await answer
            if earlier is not None:
                await earlier
            return result
        finally:
            released.set_result(None)
            if self._last_released.get(model) is released:
                del self._last_released[model]
