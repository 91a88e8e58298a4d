"""A worker's standing in Redis as the owner of a sequence model's sequences.

It registers as an owner (a member of `sequence_owners`, with a lease of its own), renews that
lease and the claims of the sequences it holds every `RENEW_S`, sets its load to the sequences
it holds, and lets a sequence idle too long go (shared/sequence_routing.py routes by these).
It also answers for owners that died: the first live owner to see a dead one's lease lapsed
removes it and answers every request left on its stream with Triton's lost-sequence error,
so no client of a dead worker's sequence waits out its timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from sluice.shared import keys
from sluice.shared.implicit_state import pack_states, unpack_states
from sluice.shared.lua import Lua
from sluice.shared.protocol import (
    ProtocolError,
    Request,
    Result,
    Tensor,
    decode_requests,
    decode_results,
    encode_results,
)
from sluice.shared.redis_client import REDIS_ERRORS
from sluice.shared.sequence_routing import CLAIM_LEASE_MS, OWNER_LEASE_MS, RELEASE, TAKE_OVER

log = logging.getLogger(__name__)

#: KEYS: the model's owners, the dead owner's lease. ARGV: the dead owner. Removes it when its
#: lease has lapsed; 1 to the one caller that did.
_BURY = Lua(
    """
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  return 1
end
return 0
"""
)


class SequenceOwnership:
    """One worker's sequences of one model, as Redis sees them."""

    def __init__(self, redis: aioredis.Redis, model: str, worker: str) -> None:
        self.redis = redis
        self.model = model
        self.worker = worker
        self.owners = keys.sequence_owners(model)
        self.stream = keys.sequence_stream(model, worker)
        self.lease = keys.sequence_lease(model, worker)
        self.held = keys.sequence_held(model, worker)

    async def renew(self, held: Iterable[int | str], count: int) -> bool:
        """Renew our lease and our claims, and say how many sequences we hold (our load).
        True when we were not among the owners: new, or taken for dead (our loop stalled past
        our lease) and our sequences answered as lost or taken over."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.lease, 1, px=OWNER_LEASE_MS)
        pipe.zadd(self.owners, {self.worker: count})
        pipe.pexpire(self.held, CLAIM_LEASE_MS)
        for sequence_id in held:
            pipe.pexpire(keys.sequence_claim(self.model, sequence_id), CLAIM_LEASE_MS)
        replies = await pipe.execute()
        return bool(replies[1])

    async def release(self, sequence_id: int | str) -> None:
        """Let a sequence go: its claim, if still ours, is deleted."""
        claim = keys.sequence_claim(self.model, sequence_id)
        await RELEASE.run(self.redis, [claim, self.held], [self.worker])

    async def retire(self) -> None:
        """We stop: our lease goes, so no new sequence comes to us and our sequences' next
        requests meet the lost error (or queue for the owner that takes them over); we stay
        among the owners until a live one has answered or moved what is left on our stream."""
        try:
            await self.redis.delete(self.lease)
        except REDIS_ERRORS as exc:
            log.warning("%s: could not retire as a sequence owner: %s", self.model, exc)

    async def take_over(self, owner: str) -> int:
        """Take a dead owner's sequences and queued requests over (a checkpointing model):
        the requests moved to our stream, or -1 if it was not ours to take."""
        script_keys = [
            self.owners,
            keys.sequence_lease(self.model, owner),
            keys.sequence_held(self.model, owner),
            keys.sequence_stream(self.model, owner),
            self.held,
            self.stream,
        ]
        moved = await TAKE_OVER.run(self.redis, script_keys, [owner, self.worker, CLAIM_LEASE_MS])
        return int(moved)

    async def checkpoint(
        self, sequence_id: int | str, states: list[Tensor], result: Result, ttl_ms: int
    ) -> None:
        """Keep a sequence's state after a step, with that step's request id and result."""
        key = keys.sequence_checkpoint(self.model, sequence_id)
        answer = encode_results([result])
        pipe = self.redis.pipeline(transaction=True)
        state = pack_states(states)
        pipe.execute_command(
            "HSET", key, "state", state, "last", result.id, "h", answer["h"], "d", answer["d"]
        )
        pipe.pexpire(key, ttl_ms)
        await pipe.execute()

    async def restore(self, sequence_id: int | str) -> tuple[list[Tensor], str, Result] | None:
        """A sequence's kept state, the id of the request of its last step and that step's
        result (None: nothing kept)."""
        kept: Any = await self.redis.hgetall(keys.sequence_checkpoint(self.model, sequence_id))
        if not kept:
            return None
        fields = {_text(k): v for k, v in kept.items()}
        (result,) = decode_results({b"h": fields["h"], b"d": fields["d"]})
        return unpack_states(fields["state"]), _text(fields["last"]), result

    async def forget(self, sequence_id: int | str) -> None:
        """The sequence ended: its kept state goes."""
        await self.redis.delete(keys.sequence_checkpoint(self.model, sequence_id))

    async def lapsed(self) -> list[str]:
        """Other owners whose lease lapsed: dead, or stopped."""
        members = [_text(m) for m in await self.redis.zrange(self.owners, 0, -1)]
        others = [m for m in members if m != self.worker]
        if not others:
            return []
        alive = await self.redis.exists(*(keys.sequence_lease(self.model, m) for m in others))
        if alive == len(others):
            return []
        pipe = self.redis.pipeline(transaction=False)
        for member in others:
            pipe.exists(keys.sequence_lease(self.model, member))
        return [m for m, up in zip(others, await pipe.execute(), strict=True) if not up]

    async def bury(self, owner: str) -> bool:
        """Remove a dead owner (a model that keeps no state): True for the one caller that did,
        which then answers its requests (`orphans`)."""
        script_keys = [self.owners, keys.sequence_lease(self.model, owner)]
        if not await _BURY.run(self.redis, script_keys, [owner]):
            return False
        await self.redis.delete(keys.sequence_held(self.model, owner))
        return True

    async def orphans(self, owner: str) -> list[Request]:
        """The requests left on a dead owner's stream, which is then deleted."""
        stream = keys.sequence_stream(self.model, owner)
        reply: Any = await self.redis.xrange(stream)
        await self.redis.delete(stream)
        requests: list[Request] = []
        for entry_id, fields in reply or ():
            try:
                requests += decode_requests(fields)
            except ProtocolError as exc:
                log.error("%s: dropping undecodable entry %r: %s", self.model, entry_id, exc)
        return requests


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
