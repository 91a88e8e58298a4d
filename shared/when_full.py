"""Small writes that land even while Redis is out of memory (maxmemory, noeviction).

Redis refuses a script's first write for memory, never a later one (it does not stop a script
halfway). So a script whose first write is the DEL of a key that never exists, which Redis does
not refuse, then runs the command it wraps. Kept for writes that a full Redis must still take
and that stay small: a member's heartbeat, which replaces its last one (else a fleet whose Redis
is full looks dead), and the error that ends a request whose result Redis refused (else its
client waits for its timeout). Each goes past maxmemory by its own few hundred bytes.
"""

from __future__ import annotations

from typing import Any

from sluice.shared.lua import Lua
from sluice.shared.redis_wire import Command

#: KEYS[1]: the command's key; KEYS[2]: a key in its slot that never exists; ARGV: the command
#: name, then its arguments after the key.
_PAST_MAXMEMORY = Lua(
    """
redis.call('DEL', KEYS[2])
return redis.call(ARGV[1], KEYS[1], unpack(ARGV, 2))
"""
)


def past_maxmemory(name: str, key: str, *args: Any) -> Command:
    """The command `name key *args` as a script call that a full Redis still runs."""
    never = f"{key}:never"  # the same hash tag, so the same slot on a cluster
    return _PAST_MAXMEMORY.command([key, never], [name, *args])
