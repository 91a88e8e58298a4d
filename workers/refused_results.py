"""Results that Redis refused for memory still end their requests, each with a small error.

A result's XADD that Redis refuses (maxmemory reached, policy noeviction) is not retried as a
lost connection is: no reconnect makes room, and a worker holding results until Redis has
room would hold its batch loop too. The results are dropped and each request they answered
gets an OutOfMemory error entry instead, so that its client hears at once, not at its timeout.

That entry must get in while Redis is full. Redis refuses a script's first write for memory,
never a later one (it does not stop a script halfway), so the script's first write is the DEL
of a key that never exists, which Redis does not refuse: the XADD after it goes through. Each
entry is a few hundred bytes, by which Redis goes past its maxmemory.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.shared.lua import Lua
from sluice.shared.protocol import Result, encode_results
from sluice.shared.redis_client import OUT_OF_MEMORY
from sluice.shared.redis_wire import Command

#: what each request whose result Redis refused is answered.
REFUSED = f"{OUT_OF_MEMORY}: the request ran but its result could not be stored"

#: KEYS[1]: the reply stream; KEYS[2]: a key in its slot that never exists.
ANSWER_WHEN_FULL = Lua(
    """
redis.call('DEL', KEYS[2])
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'h', ARGV[2], 'd', ARGV[3])
"""
)


def refused_answers(results: Sequence[Result]) -> list[Result]:
    """One final OutOfMemory error for each request among `results`, in order."""
    ids = dict.fromkeys(result.id for result in results)
    return [Result(request_id, error=("RESOURCE_EXHAUSTED", REFUSED)) for request_id in ids]


def answer_command(route: str, answers: Sequence[Result], maxlen: int) -> Command:
    """The script call adding `answers` to `route` even while Redis is out of memory."""
    fields = encode_results(answers)
    never = f"{route}:never"  # the same hash tag, so the same slot on a cluster
    return ANSWER_WHEN_FULL.command([route, never], [maxlen, fields["h"], fields["d"]])
