"""Results back: one task reads this gateway's reply stream and resolves every waiter.

Workers append each batch's answers for this gateway as one entry of its reply stream; a
blocking XREAD takes up to 256 entries at a time, so Redis work per answer shrinks as load
grows. Read entries are trimmed every `TRIM_EVERY_ENTRIES`. The trim is approximate (MINID ~):
Redis drops whole nodes of read entries and never edits a node in place; at most a node's worth
of read entries stays behind until the next trim. After a Redis restart the stream is read
again from its start (gateway/outage.py), and each id is resolved once. The gateway runs the
reader under a supervisor (gateway/background.py): should it fail, the requests waiting are
failed with `fail_waiting`, and it reads again from the entry after the one it failed on.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from sluice.gateway.outage import RETRY_CAP_S, RETRY_FIRST_S, Outage
from sluice.gateway.response_order import ResponseOrder
from sluice.shared.backoff import Backoff
from sluice.shared.idle_poll import IdlePoll
from sluice.shared.protocol import ProtocolError, Result, settle_results
from sluice.shared.redis_client import CONNECTION_ERRORS, REDIS_ERRORS
from sluice.shared.redis_wire import Wire, stream_entries

log = logging.getLogger(__name__)

TRIM_EVERY_ENTRIES = 64
REPLY_READ_BLOCK_MS = 1000


@dataclass(slots=True)
class ReplyReader:
    """Resolves the waiting requests (and feeds the streamed ones) from the reply stream."""

    reader: aioredis.Redis
    #: the reply read's own connection (shared/redis_wire.py).
    reads: Wire
    reply_stream: str
    outage: Outage[Any]
    waiting: dict[str, asyncio.Future[Result]]
    streams: dict[str, ResponseOrder]
    idle_poll: IdlePoll
    #: the last entry read, kept across runs: a run that failed on an entry is not fed it again.
    last_id: bytes = field(default=b"0-0", init=False)

    async def run(self) -> None:
        """Read until cancelled; survives Redis outages."""
        unread_trim = 0
        backoff = Backoff.doubling(RETRY_FIRST_S, RETRY_CAP_S)
        await self.outage.learn_server()
        while True:
            if self.outage.reread_replies:
                self.outage.reread_replies, self.last_id = False, b"0-0"
            try:
                if unread_trim >= TRIM_EVERY_ENTRIES:
                    await self.reader.xtrim(self.reply_stream, minid=self.last_id, approximate=True)
                    unread_trim = 0
                reply = await self.reads.call(
                    *("XREAD", "COUNT", 256, "BLOCK", REPLY_READ_BLOCK_MS),
                    *("STREAMS", self.reply_stream, self.last_id),
                )
            except REDIS_ERRORS as exc:
                if backoff.failures == 0:
                    log.warning("reply stream read failed (%s); reconnecting", exc)
                if isinstance(exc, CONNECTION_ERRORS):
                    self.outage.begin(exc)
                await asyncio.sleep(backoff.next_s())
                continue
            backoff.reset()
            for _stream, entries in stream_entries(reply):
                for entry_id, fields in entries:
                    self.last_id = entry_id
                    unread_trim += 1
                    self._resolve(fields)
            if reply:
                self.idle_poll.arm()
                # the resolved requests' answers go out before the next read is sent: that
                # write wakes Redis, and at low load it would hold up the clients' replies
                await asyncio.sleep(0)

    def fail_waiting(self, error: Exception) -> None:
        """Every request still waiting for its answer (a streamed one too) gets `error`."""
        for future in list(self.waiting.values()):
            if not future.done():
                future.set_exception(error)

    def _resolve(self, fields: dict[bytes, bytes]) -> None:
        try:
            settle_results(fields, self.waiting, self._streamed)
        except ProtocolError as exc:
            log.error("undecodable reply entry: %s", exc)

    def _streamed(self, result: Result) -> None:
        order = self.streams.get(result.id)
        if order is not None:
            order.receive(result)
