"""Pauses between the attempts of a loop that rides out failures (a lost Redis, a failed task).

Each retry loop takes its pauses from a `Backoff` rather than keeping its own counter, so every
loop backs off the same way: from a first pause, longer after each failure up to a cap, and
from the first again once an attempt succeeds.
"""

from __future__ import annotations

from collections.abc import Sequence


class Backoff:
    """The pauses after consecutive failures: `delays_s` in turn, the last one repeating."""

    __slots__ = ("_failures", "delays_s")

    def __init__(self, delays_s: Sequence[float]) -> None:
        if not delays_s:
            raise ValueError("a backoff needs at least one delay")
        self.delays_s = tuple(delays_s)
        self._failures = 0

    @classmethod
    def doubling(cls, first_s: float, max_s: float) -> Backoff:
        """Pauses of `first_s`, twice that, and so on, capped at `max_s`."""
        delays_s = [first_s]
        while (following_s := min(delays_s[-1] * 2, max_s)) != delays_s[-1]:
            delays_s.append(following_s)
        return cls(delays_s)

    @property
    def failures(self) -> int:
        """Failures counted since the last success (0: the next one is the first)."""
        return self._failures

    def next_s(self) -> float:
        """Count a failure; the pause to take before the next attempt."""
        delay_s = self.delays_s[min(self._failures, len(self.delays_s) - 1)]
        self._failures += 1
        return delay_s

    def reset(self) -> None:
        """An attempt succeeded: the next failure pauses for the first delay again."""
        self._failures = 0
