"""Requests out to the model streams, results back from this gateway's reply stream.

Requests that arrive in the same event-loop turn go to Redis as one entry per model in one
pipeline; one reader task resolves every waiter from the reply stream. Redis work per request
is therefore O(1) and shrinks as load grows.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter, defaultdict

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys
from shared.errors import Unavailable
from shared.protocol import ProtocolError, Request, Result, decode_results, encode_requests

log = logging.getLogger(__name__)

#: trim the reply stream once this many entries have been read since the last trim.
TRIM_EVERY_ENTRIES = 64
REPLY_READ_BLOCK_MS = 1000


class Dispatcher:
    def __init__(self, redis: aioredis.Redis, reader: aioredis.Redis, gateway_id: str) -> None:
        self.redis = redis
        self.reader = reader
        self.reply_stream = keys.reply_stream(gateway_id)
        self.waiting: dict[str, asyncio.Future[Result]] = {}
        self._prefix = gateway_id
        self._ids = itertools.count()
        self._outbox: dict[str, list[Request]] = defaultdict(list)
        self._entry_limit: dict[str, int] = {}
        self._flush_scheduled = False
        self._sending: set[asyncio.Task[None]] = set()
        #: "model:version" -> requests sent and not yet answered.
        self.inflight: Counter[str] = Counter()
        #: per model with preserve_ordering: released when the latest request was answered.
        self._last_released: dict[str, asyncio.Future[None]] = {}

    def new_request_id(self) -> str:
        return f"{self._prefix}:{next(self._ids)}"

    async def submit(
        self,
        model: str,
        request: Request,
        max_per_entry: int,
        timeout_s: float,
        preserve_ordering: bool = False,
    ) -> Result:
        """Queue `request` on `model`'s stream and wait for its result.

        With `preserve_ordering` (Triton's dynamic_batching option) a result is released only
        after every earlier request to the same model through this gateway was answered.
        """
        if not preserve_ordering:
            return await self._submit(model, request, max_per_entry, timeout_s)
        loop = asyncio.get_running_loop()
        earlier = self._last_released.get(model)
        released: asyncio.Future[None] = loop.create_future()
        self._last_released[model] = released
        try:
            result = await self._submit(model, request, max_per_entry, timeout_s)
            if earlier is not None:
                await earlier
            return result
        finally:
            released.set_result(None)
            if self._last_released.get(model) is released:
                del self._last_released[model]

    async def _submit(
        self, model: str, request: Request, max_per_entry: int, timeout_s: float
    ) -> Result:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        self.waiting[request.id] = future
        self._outbox[model].append(request)
        self._entry_limit[model] = max(1, max_per_entry)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        slot = f"{model}:{request.version}"
        self.inflight[slot] += 1
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise Unavailable("Request timeout expired") from None
        finally:
            self.waiting.pop(request.id, None)
            self.inflight[slot] -= 1

    def _flush(self) -> None:
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, defaultdict(list)
        task = asyncio.create_task(self._send(outbox))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, outbox: dict[str, list[Request]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for model, requests in outbox.items():
            step = self._entry_limit.get(model, 1)
            for start in range(0, len(requests), step):
                entry = encode_requests(requests[start : start + step])
                pipe.xadd(keys.request_stream(model), entry)
        try:
            await pipe.execute()
        except RedisError as exc:
            error = Unavailable(f"queue unavailable: {exc}")
            for requests in outbox.values():
                for request in requests:
                    future = self.waiting.get(request.id)
                    if future is not None and not future.done():
                        future.set_exception(error)

    async def read_replies(self) -> None:
        """Resolve waiters from the reply stream until cancelled; survives Redis outages."""
        last_id = b"0-0"
        unread_trim = 0
        backoff = 0.05
        while True:
            try:
                if unread_trim >= TRIM_EVERY_ENTRIES:
                    await self.reader.xtrim(self.reply_stream, minid=last_id, approximate=False)
                    unread_trim = 0
                reply = await self.reader.xread(
                    {self.reply_stream: last_id}, block=REPLY_READ_BLOCK_MS, count=256
                )
                backoff = 0.05
            except RedisError as exc:
                log.warning("reply stream read failed (%s); retrying in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    last_id = entry_id
                    unread_trim += 1
                    self._resolve(fields)

    def _resolve(self, fields: dict[bytes, bytes]) -> None:
        try:
            results = decode_results(fields)
        except ProtocolError as exc:
            log.error("undecodable reply entry: %s", exc)
            return
        for result in results:
            future = self.waiting.get(result.id)
            if future is not None and not future.done():
                future.set_result(result)

    def inflight_snapshot(self) -> dict[str, int]:
        return {slot: n for slot, n in self.inflight.items() if n}

    async def close(self) -> None:
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
