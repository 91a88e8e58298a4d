"""Lua scripts sent as EVAL with their source, among the other commands of a round trip.

redis-py's Script checks SCRIPT EXISTS before every pipeline that uses one: a round trip per
batch on the hot path, and on a cluster the check goes to the wrong nodes. EVAL with the source
costs a few hundred bytes instead (Redis keeps the compiled script by its SHA), never meets
NOSCRIPT after a restart or failover, and is routed by its keys like any command.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Lua:
    def __init__(self, source: str) -> None:
        self.source = source

    def command(self, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
        """A call of the script, as a command to send."""
        return ("EVAL", self.source, len(keys), *keys, *args)
