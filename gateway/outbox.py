"""What a gateway sends in one round trip: its outbox of requests, as stream commands.

Requests for one model and priority level share stream entries of up to the model's
max_batch_size, each entry dealt to the model's next partition. A level with a max_queue_size
sends one entry per request through the admission script instead, so that the limit admits
or refuses each request on its own, as Triton's does. A request of a sequence goes through the
sequence routing script, to the worker that owns its sequence (shared/sequence_routing.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.shared import keys
from sluice.shared.admission import ENQUEUE
from sluice.shared.partitions import Dealer
from sluice.shared.protocol import Request, encode_requests
from sluice.shared.redis_wire import Command, xadd
from sluice.shared.sequence_routing import route_command


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: its model's stream for its priority level, and the limits."""

    model: str
    level: int = 0
    #: requests per stream entry (the model's max_batch_size, at least 1).
    max_per_entry: int = 1
    #: Triton's max_queue_size for the level (0: unbounded), per partition: its share.
    max_queue_size: int = 0
    #: the model's stream partitions (shared/partitions.py), dealt entries in turn.
    partitions: int = 1
    #: the model is under Triton's sequence batcher: each request is routed to the worker
    #: that owns its sequence (shared/sequence_routing.py).
    sequenced: bool = False
    #: ... and keeps its sequences' state in Redis (SEQUENCE_STATE_CHECKPOINT).
    checkpointed: bool = False


@dataclass(frozen=True, slots=True)
class Send:
    """One command of an outbox and the requests it carries (each fails with it alone)."""

    command: Command
    requests: list[Request]
    #: an admission script: its reply says which of `requests` it admitted.
    bounded: bool = False
    #: a sequence's routing script: its reply says whether its one request was queued.
    sequenced: bool = False


def outbox_commands(outbox: dict[Route, list[Request]], dealer: Dealer) -> list[Send]:
    """The commands that send `outbox`, in order, each with its requests."""
    sends: list[Send] = []
    for route, requests in outbox.items():
        if route.sequenced:
            for request in requests:
                entry = encode_requests([request])
                command = route_command(route.model, request.parameters, entry, route.checkpointed)
                sends.append(Send(command, [request], sequenced=True))
            continue
        if route.max_queue_size:
            partition = dealer.next(route.model, route.level, route.partitions)
            stream = keys.request_stream(route.model, route.level, partition)
            args: list[int | bytes] = [route.level, route.max_queue_size]
            for request in requests:
                entry = encode_requests([request])
                args += [entry["h"], entry["d"]]
            sizes = keys.queue_sizes(route.model, partition)
            sends.append(Send(ENQUEUE.command([stream, sizes], args), requests, bounded=True))
            continue
        for start in range(0, len(requests), route.max_per_entry):
            partition = dealer.next(route.model, route.level, route.partitions)
            stream = keys.request_stream(route.model, route.level, partition)
            shared = requests[start : start + route.max_per_entry]
            sends.append(Send(xadd(stream, encode_requests(shared)), shared))
    return sends
