"""A finished ensemble step goes on: its outputs to the next steps' streams, or the answer.

Called by the publisher with the batch's results whose requests carry a continuation; it
returns the commands that must reach Redis before the batch is acknowledged (sent in the same
pipeline, ahead of the ack), so a worker killed before the ack leaves the step to be taken over
and run again, never lost. Steps fed by this one alone get their request at once; steps that
join several producers go through the request's join state (one JOIN call per request, all in
one round trip). A failed step answers the gateway with its error at once, and so does one whose
join state or next request Redis refuses for memory (workers/answers/refused_results.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from sluice.shared.ensemble_wire import (
    Continuation,
    answer,
    direct_consumers,
    failure,
    join_command,
    produced,
    ready_steps,
    step_request,
)
from sluice.shared.protocol import Request, Result, Tensor, encode_requests, encode_results
from sluice.shared.redis_client import out_of_memory
from sluice.shared.redis_wire import Command, Wire, xadd
from sluice.workers.answers.refused_results import refused_answers

#: the error of a step that did not return an output the ensemble maps.
MISSING_OUTPUT = "INTERNAL"


class Onward:
    """The requests and answers a batch's finished steps send on, grouped per stream."""

    def __init__(self) -> None:
        self.requests: dict[str, list[Request]] = defaultdict(list)
        self.answers: dict[str, list[Result]] = defaultdict(list)
        self.now_ns = time.time_ns()

    def route(
        self,
        parent: Request,
        cont: Continuation,
        consumer: int,
        tensors: dict[str, Tensor],
        timestamps: list[int] | None = None,
    ) -> None:
        """Send `consumer` (a step, or the answer) its tensors; a traced answer carries the
        last step's compute `timestamps` to the gateway."""
        plan = cont.plan
        missing = [t for t in plan.needs(consumer, cont.requested) if t not in tensors]
        if missing:
            step = plan.steps[cont.step].model
            error = (MISSING_OUTPUT, f"model '{step}' did not return '{missing[0]}'")
            self.answers[cont.reply_to].append(failure(parent.id, plan, error))
        elif consumer == plan.final:
            answered = answer(parent.id, cont, tensors)
            answered.timestamps = timestamps
            self.answers[cont.reply_to].append(answered)
        else:
            stream, request = step_request(parent, cont, consumer, tensors, self.now_ns)
            self.requests[stream].append(request)

    def commands(self, reply_maxlen: int) -> list[Outgoing]:
        sends = [
            Outgoing(xadd(s, encode_requests(rs)), [(r.reply_to, r.id) for r in rs])
            for s, rs in self.requests.items()
        ]
        sends += [
            Outgoing(
                xadd(route, encode_results(rs), "MAXLEN", "~", reply_maxlen),
                [(route, r.id) for r in rs],
            )
            for route, rs in self.answers.items()
        ]
        return sends


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A command that carries ensemble requests on, and who waits for them: the gateway reply
    stream and id of each request, to answer should Redis refuse the command."""

    command: Command
    waiting: list[tuple[str, str]]


async def continue_steps(
    wire: Wire, finished: Sequence[tuple[Request, Result]], reply_maxlen: int
) -> list[Outgoing]:
    """The commands that carry `finished` steps on (to send before their ack)."""
    onward = Onward()
    joins: list[tuple[Request, Continuation, list[int] | None]] = []
    join_calls: list[Command] = []
    for request, result in finished:
        assert request.continuation is not None
        cont = Continuation.decode(request.continuation)
        if result.error is not None:
            onward.answers[cont.reply_to].append(failure(request.id, cont.plan, result.error))
            continue
        tensors = produced(request, cont, result.outputs)
        for consumer in direct_consumers(cont, cont.step):
            onward.route(request, cont, consumer, tensors, result.timestamps)
        call = join_command(request.id, cont, cont.step, tensors)
        if call is not None:
            joins.append((request, cont, result.timestamps))
            join_calls.append(call)
    if join_calls:
        replies = await wire.execute(*join_calls, raise_on_error=False)
        for (request, cont, stamps), reply in zip(joins, replies, strict=True):
            if isinstance(reply, Exception):
                if not out_of_memory(reply):
                    raise reply
                onward.answers[cont.reply_to] += refused_answers([request.id])
                continue
            for consumer, tensors in ready_steps(cont, reply):
                onward.route(request, cont, consumer, tensors, stamps)
    return onward.commands(reply_maxlen)
