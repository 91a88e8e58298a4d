"""Results that Redis refused for memory still end their requests, each with a small error.

A result's XADD that Redis refuses (maxmemory reached, policy noeviction) is not retried as a
lost connection is: no reconnect makes room, and a worker holding results until Redis has
room would hold its batch loop too. The results are dropped and each request they answered
gets an OutOfMemory error entry instead, written so that a full Redis takes it
(shared/when_full.py), so that its client hears at once, not at its timeout.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.shared.protocol import Result, encode_results
from sluice.shared.redis_client import OUT_OF_MEMORY
from sluice.shared.redis_wire import Command
from sluice.shared.when_full import past_maxmemory

#: what each request whose result Redis refused is answered.
REFUSED = f"{OUT_OF_MEMORY}: the request ran but its result could not be stored"


def refused_answers(request_ids: Sequence[str]) -> list[Result]:
    """One final OutOfMemory error for each of the requests, in order, each once."""
    error = ("RESOURCE_EXHAUSTED", REFUSED)
    return [Result(request_id, error=error) for request_id in dict.fromkeys(request_ids)]


def answer_command(route: str, answers: Sequence[Result], maxlen: int) -> Command:
    """The XADD of `answers` to `route`, which a full Redis still takes."""
    fields = encode_results(answers)
    return past_maxmemory(
        "XADD", route, "MAXLEN", "~", maxlen, "*", "h", fields["h"], "d", fields["d"]
    )
