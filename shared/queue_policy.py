"""Triton's queue policy (priority levels, queue size limits, timeouts), read from the config.

The gateway uses it to pick a request's priority stream and enforce `max_queue_size`; the
worker uses it to expire or delay requests that waited too long. Beyond Triton, a request
may carry `deadline_us`: a limit on its whole life (queue and execution) that needs no
server default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.shared.errors import InvalidInput

#: request parameters this module reads.
PRIORITY = "priority"
TIMEOUT = "timeout"
DEADLINE = "deadline_us"


@dataclass(frozen=True, slots=True)
class LevelPolicy:
    timeout_action: str = "REJECT"  # or "DELAY"
    default_timeout_us: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0

    @classmethod
    def from_json(cls, raw: Mapping[str, Any] | None) -> LevelPolicy:
        raw = raw or {}
        return cls(
            str(raw.get("timeout_action", "REJECT")),
            int(raw.get("default_timeout_microseconds", 0)),
            bool(raw.get("allow_timeout_override", False)),
            int(raw.get("max_queue_size", 0)),
        )


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    #: 0: one queue. Otherwise levels 1..N, 1 the highest.
    priority_levels: int = 0
    default_priority_level: int = 0
    default: LevelPolicy = LevelPolicy()
    per_level: dict[int, LevelPolicy] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> QueuePolicy:
        batching = config.get("dynamic_batching") or {}
        levels = int(batching.get("priority_levels", 0))
        return cls(
            levels,
            int(batching.get("default_priority_level", 0)) or (levels and 1),
            LevelPolicy.from_json(batching.get("default_queue_policy")),
            {
                int(level): LevelPolicy.from_json(raw)
                for level, raw in (batching.get("priority_queue_policy") or {}).items()
            },
        )

    @property
    def levels(self) -> tuple[int, ...]:
        """The queues, highest priority first (0 alone when priorities are off)."""
        return tuple(range(1, self.priority_levels + 1)) if self.priority_levels else (0,)

    def for_level(self, level: int) -> LevelPolicy:
        return self.per_level.get(level, self.default)

    def level_of(self, params: Mapping[str, Any]) -> int:
        """Triton: a priority of 0 or above the number of levels means the default level."""
        if not self.priority_levels:
            return 0
        priority = _int_param(params, PRIORITY)
        if priority is None or priority == 0 or priority > self.priority_levels:
            return self.default_priority_level
        return priority

    def queue_timeout_us(self, level: int, params: Mapping[str, Any]) -> int:
        """Triton: the request's `timeout` counts only if allowed and below a non-zero default."""
        policy = self.for_level(level)
        requested = _int_param(params, TIMEOUT)
        if (
            policy.allow_timeout_override
            and requested is not None
            and 0 < requested < policy.default_timeout_us
        ):
            return requested
        return policy.default_timeout_us


def deadline_us(params: Mapping[str, Any]) -> int:
    """The request's own limit on queue + execution time (0: none)."""
    return _int_param(params, DEADLINE) or 0


def _int_param(params: Mapping[str, Any], name: str) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"request parameter '{name}' must be a non-negative integer")
    return value
