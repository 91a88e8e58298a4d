"""What the soak counts: every answer's outcome, and the chaos it made meanwhile.

Its own module so that the soak and its summary both read these without importing each other.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    clear: Counter[tuple[int, str]] = field(default_factory=Counter)
    lost: Counter[str] = field(default_factory=Counter)
    wrong: Counter[str] = field(default_factory=Counter)
    answered: set[str] = field(default_factory=set)
    latencies_s: list[float] = field(default_factory=list)
    #: lost requests: (seconds after t0 when sent, id, why).
    lost_log: list[tuple[float, str, str]] = field(default_factory=list)
    t0_s: float = field(default_factory=time.monotonic)
    last_answer_s: float = 0.0

    def lose(self, why: str, request_id: str, sent_s: float) -> None:
        self.lost[why] += 1
        self.lost_log.append((sent_s - self.t0_s, request_id, why))

    @property
    def done(self) -> int:
        return (
            self.ok + sum(self.clear.values()) + sum(self.lost.values()) + sum(self.wrong.values())
        )


@dataclass
class Chaos:
    kills: int = 0
    kill_misses: int = 0
    redis_restarts: int = 0
    redis_restart_s: float = 0.0
    #: (seconds after t0, what happened).
    events: list[tuple[float, str]] = field(default_factory=list)
    t0_s: float = field(default_factory=time.monotonic)

    def note(self, what: str) -> None:
        self.events.append((time.monotonic() - self.t0_s, what))
