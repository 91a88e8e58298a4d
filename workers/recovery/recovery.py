"""Crash recovery for one model's stream: keep our own entries alive, take over the dead's.

Every entry a worker holds is re-claimed by it every `claim_idle_ms / 3`, so its idle time
only grows once its worker is gone. Entries idle longer than `claim_idle_ms` are taken over
with XAUTOCLAIM. A reclaimed entry is a suspect: if it holds several requests it is split
into one entry per request (each then counts its own deliveries), and a single request runs
alone; one delivered more than `max_deliveries` times is moved to the dead-letter stream.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT
from sluice.shared import keys
from sluice.shared.lua import Lua
from sluice.shared.protocol import Request, encode_requests
from sluice.shared.stats import DEAD_LETTERED, RECLAIMED

log = logging.getLogger(__name__)

DEAD_LETTER_MAXLEN = 10_000
#: consumers idle this many claim periods with nothing pending are removed from the group.
STALE_CONSUMER_PERIODS = 10

#: XADD each request as its own entry, then ack and delete the entry they came from.
SPLIT = Lua(
    """
for i = 3, #ARGV, 2 do
  redis.call('XADD', KEYS[1], '*', 'h', ARGV[i], 'd', ARGV[i + 1])
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""
)


@dataclass(frozen=True, slots=True)
class Claimed:
    entry_id: bytes
    #: None when the entry was deleted from the stream while pending.
    fields: dict[bytes, bytes] | None
    deliveries: int


@dataclass(frozen=True, slots=True)
class RecoveryPolicy:
    claim_idle_ms: int = 10_000
    max_deliveries: int = 3


class Recovery:
    def __init__(
        self,
        redis: aioredis.Redis,
        model: str,
        stream: str,
        consumer: str,
        policy: RecoveryPolicy,
    ) -> None:
        self.redis = redis
        self.model = model
        self.stream = stream
        self.dead_stream = keys.dead_letters(model)
        self.consumer = consumer
        self.policy = policy

    @property
    def interval_s(self) -> float:
        return self.policy.claim_idle_ms / 3000

    async def keep_alive(self, held: Collection[bytes]) -> None:
        """Reset the idle time of the entries we hold, so nobody takes them over."""
        if held:
            await self.redis.xclaim(
                self.stream, keys.WORKER_GROUP, self.consumer, 0, list(held), justid=True
            )

    async def claim(self, count: int) -> list[Claimed]:
        """Take over up to `count` entries whose holder stopped refreshing them."""
        reply = await self.redis.xautoclaim(
            self.stream,
            keys.WORKER_GROUP,
            self.consumer,
            self.policy.claim_idle_ms,
            start_id="0-0",
            count=count,
        )
        entries = reply[1]
        if not entries:
            return []
        await self.redis.hincrby(keys.model_stats(self.model), RECLAIMED, len(entries))
        ids = [entry_id for entry_id, _ in entries]
        pending = await self.redis.xpending_range(
            self.stream,
            keys.WORKER_GROUP,
            min=min(ids),
            max=max(ids),
            count=len(ids) * 4,
            consumername=self.consumer,
        )
        deliveries = {p["message_id"]: p["times_delivered"] for p in cast("list[Any]", pending)}
        return [
            Claimed(entry_id, fields or None, deliveries.get(entry_id, 2))
            for entry_id, fields in entries
        ]

    def too_often(self, claimed: Claimed) -> bool:
        return claimed.deliveries > self.policy.max_deliveries

    async def split(self, entry_id: bytes, requests: Sequence[Request]) -> None:
        args: list[bytes | str] = [keys.WORKER_GROUP, entry_id]
        for request in requests:
            fields = encode_requests([request])
            args += [fields["h"], fields["d"]]
        await SPLIT.run(self.redis, [self.stream], args)
        log.warning("%s: split reclaimed entry %r into %d", self.model, entry_id, len(requests))

    async def dead_letter(self, claimed: Claimed, reason: str) -> None:
        """Keep the entry for inspection; the caller answers its requests and acks it."""
        fields = dict(claimed.fields or {})
        fields.update(
            {
                b"entry_id": claimed.entry_id,
                b"deliveries": str(claimed.deliveries).encode(),
                b"reason": reason.encode(),
                b"last_consumer": self.consumer.encode(),
            }
        )
        dead = cast("dict[FieldT, EncodableT]", fields)
        await self.redis.xadd(self.dead_stream, dead, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        await self.redis.hincrby(keys.model_stats(self.model), DEAD_LETTERED, 1)
        log.error("%s: entry %r dead-lettered: %s", self.model, claimed.entry_id, reason)

    async def prune_consumers(self) -> None:
        """Forget consumers of dead workers once nothing is pending on them."""
        stale_ms = self.policy.claim_idle_ms * STALE_CONSUMER_PERIODS
        for consumer in await self.redis.xinfo_consumers(self.stream, keys.WORKER_GROUP):
            name = consumer["name"]
            name = name.decode() if isinstance(name, bytes) else name
            if name != self.consumer and consumer["pending"] == 0 and consumer["idle"] > stale_ms:
                await self.redis.xgroup_delconsumer(self.stream, keys.WORKER_GROUP, name)
