"""What a sequence model's owner does for the fleet beside running its sequences: keep its
lease, claims and load current, answer for owners that died (or take their sequences over,
with checkpoints), and route the requests other producers put on the model's own streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from sluice.shared import keys
from sluice.shared.errors import SluiceError
from sluice.shared.protocol import Request, Result, encode_requests
from sluice.shared.sequence_controls import SEQUENCE_ID, check_sequence_request
from sluice.shared.sequence_routing import RENEW_S, route_command, route_error, sequence_lost
from sluice.workers.batching.answering import Answering
from sluice.workers.batching.batcher import Pending
from sluice.workers.batching.pending import Queued
from sluice.workers.sequences.ownership import SequenceOwnership
from sluice.workers.sequences.sequence_batcher import SequenceBatcher

log = logging.getLogger(__name__)


class OwnerDuties:
    """One worker's duties as an owner of one model's sequences."""

    def __init__(
        self,
        model: str,
        ownership: SequenceOwnership,
        batcher: SequenceBatcher[Queued],
        answering: Answering,
        checkpointed: bool,
    ) -> None:
        self.model = model
        self.ownership = ownership
        self.batcher = batcher
        self.answering = answering
        self.checkpointed = checkpointed
        #: sequences came or went: renew (our load) now.
        self.changed = asyncio.Event()

    async def keep(self, retired: Callable[[], bool], forfeit: Callable[[], None]) -> None:
        """Renew our lease, claims and load every `RENEW_S` (and when sequences come or go)
        until we retire, and answer for the owners that died. Taken for dead ourselves, we
        `forfeit` the sequences we hold: another owner answered or took them."""
        registered = False
        while not retired():
            held = list(self.batcher.known)
            if await self.ownership.renew(held, self.batcher.holding) and registered:
                log.error(
                    "%s: this worker was taken for dead (its loop stalled past its lease): "
                    "its %d sequences were answered as lost or taken over elsewhere",
                    *(self.model, self.batcher.holding),
                )
                forfeit()
            registered = True
            for owner in await self.ownership.lapsed():
                if self.checkpointed:
                    moved = await self.ownership.take_over(owner)
                    if moved >= 0:
                        log.warning(
                            "%s: worker %s died: its sequences go on here (%d requests moved)",
                            *(self.model, owner, moved),
                        )
                elif await self.ownership.bury(owner):
                    await self._answer_orphans(owner)
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), RENEW_S)

    async def _answer_orphans(self, owner: str) -> None:
        """The requests left on a dead owner's stream get the lost-sequence error."""
        requests = await self.ownership.orphans(owner)
        if requests:
            log.warning(
                "%s: worker %s died holding sequences: %d requests answered as lost",
                *(self.model, owner, len(requests)),
            )
        stream = keys.sequence_stream(self.model, owner)
        await self.answering.reject([(_orphan(r, stream), self.lost(r)) for r in requests])

    def lost(self, request: Request) -> Result:
        error = sequence_lost(self.model, request.parameters.get(SEQUENCE_ID, 0))
        return Result(request.id, error=(error.code, error.message))

    async def forward(self, items: list[Queued]) -> None:
        """Requests read from the model's own streams (put there by a job, a BLS call, the
        direct client) go to the owner of their sequence, as a gateway would route them."""
        refused: list[tuple[Queued, Result]] = []
        sent: list[Queued] = []
        for item in items:
            request = item.request
            try:
                check_sequence_request(self.model, request.parameters, item.pending.batch_size)
                command = route_command(
                    self.model, request.parameters, encode_requests([request]), self.checkpointed
                )
                reply = await self.ownership.redis.execute_command(*command)
                error = route_error(self.model, request.parameters[SEQUENCE_ID], reply)
            except SluiceError as exc:
                error = exc
            if error is None:
                sent.append(item)
            else:
                refused.append((item, Result(request.id, error=(error.code, error.message))))
        await self.answering.reject(refused)
        await self.answering.publisher.forwarded(sent)


def _orphan(request: Request, stream: str) -> Queued:
    """A request read off a dead owner's (deleted) stream, to be answered."""
    return Queued(request, stream, b"0-0", Pending(None, 1, 0))
