"""Every Lua script of sluice, sent as EVAL with its source, one way for every caller.

redis-py's Script checks SCRIPT EXISTS before every pipeline that uses one: a round trip per
batch on the hot path, and on a cluster the check goes to the wrong nodes. EVAL with the source
costs a few hundred bytes instead (Redis keeps the compiled script by its SHA), never meets
NOSCRIPT after a restart or failover, and is routed by its keys like any command. A script's
keys must share one hash tag, so that a cluster runs it on one node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class _Client(Protocol):
    """A sync or asyncio redis-py client (plain, Sentinel or cluster) or pipeline."""

    def execute_command(self, *args: Any, **options: Any) -> Any: ...


class Lua:
    """One script: `command` for a round trip of several commands, `run` for a call alone."""

    def __init__(self, source: str) -> None:
        self.source = source

    def command(self, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
        """A call of the script, as a command to send."""
        return ("EVAL", self.source, len(keys), *keys, *args)

    def run(self, client: _Client, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        """The script's reply on a sync client; an awaitable of it on an asyncio client."""
        return client.execute_command(*self.command(keys, args))
