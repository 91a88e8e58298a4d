"""Requests out to the model streams, results back from this gateway's reply stream.

Requests that arrive in the same event-loop turn go to Redis as one entry per model in one
round trip; one reader task resolves every waiter from the reply stream. Redis work per request
is therefore O(1) and shrinks as load grows.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import keys
from shared.errors import Cancelled, Unavailable
from shared.idle_poll import DEFAULT_WINDOW_US, IdlePoll
from shared.lua import Lua
from shared.protocol import ProtocolError, Request, Result, decode_results, encode_requests
from shared.redis_client import REDIS_ERRORS, server_info
from shared.redis_wire import Command, Wire, stream_entries, xadd

log = logging.getLogger(__name__)

#: trim the reply stream once this many entries have been read since the last trim.
TRIM_EVERY_ENTRIES = 64
REPLY_READ_BLOCK_MS = 1000


#: admit each request while its priority level's queue has room; report which were admitted.
ENQUEUE_LUA = """
local size = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local limit = tonumber(ARGV[2])
local admitted = {}
for i = 3, #ARGV, 2 do
  if size < limit then
    redis.call('XADD', KEYS[1], '*', 'h', ARGV[i], 'd', ARGV[i + 1])
    size = size + 1
    admitted[#admitted + 1] = 1
  else
    admitted[#admitted + 1] = 0
  end
end
redis.call('HSET', KEYS[2], ARGV[1], size)
return admitted
"""


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: its model's stream for its priority level, and the limits."""

    model: str
    level: int = 0
    #: requests per stream entry (the model's max_batch_size, at least 1).
    max_per_entry: int = 1
    #: Triton's max_queue_size for the level (0: unbounded).
    max_queue_size: int = 0


def _expire(future: asyncio.Future[Result], message: str) -> None:
    if not future.done():
        future.set_exception(Unavailable(message))


def _ignore_failure(task: asyncio.Future[object]) -> None:
    if not task.cancelled():
        task.exception()


class Dispatcher:
    def __init__(
        self,
        redis: aioredis.Redis,
        reader: aioredis.Redis,
        gateway_id: str,
        idle_poll_us: int = DEFAULT_WINDOW_US,
    ) -> None:
        self.redis = redis
        self.reader = reader
        #: the hot path's commands on connections of their own: sends, and the reply read.
        self._sends = Wire(redis)
        self._reads = Wire(reader)
        self.reply_stream = keys.reply_stream(gateway_id)
        self.waiting: dict[str, asyncio.Future[Result]] = {}
        self._prefix = gateway_id
        self._ids = itertools.count()
        self._outbox: dict[Route, list[Request]] = defaultdict(list)
        self._enqueue = Lua(ENQUEUE_LUA)
        self._flush_scheduled = False
        self._sending: set[asyncio.Task[None]] = set()
        #: "model:version" -> requests sent and not yet answered.
        self.inflight: Counter[str] = Counter()
        #: per model with preserve_ordering: released when the latest request was answered.
        self._last_released: dict[str, asyncio.Future[None]] = {}
        #: with one request in flight, poll for its reply and the client's next request
        self.idle_poll = IdlePoll(idle_poll_us * 1000, lambda: len(self.waiting) <= 1)

    def new_request_id(self) -> str:
        return f"{self._prefix}:{next(self._ids)}"

    async def submit(
        self,
        route: Route,
        request: Request,
        timeout_s: float,
        preserve_ordering: bool = False,
        timeout_message: str = "Request timeout expired",
    ) -> Result:
        """Queue `request` on its model's stream and wait for its result.

        With `preserve_ordering` (Triton's dynamic_batching option) a result is released only
        after every earlier request to the same model through this gateway was answered.
        """
        if not preserve_ordering:
            return await self._submit(route, request, timeout_s, timeout_message)
        loop = asyncio.get_running_loop()
        earlier = self._last_released.get(route.model)
        released: asyncio.Future[None] = loop.create_future()
        self._last_released[route.model] = released
        try:
            result = await self._submit(route, request, timeout_s, timeout_message)
            if earlier is not None:
                await earlier
            return result
        finally:
            released.set_result(None)
            if self._last_released.get(route.model) is released:
                del self._last_released[route.model]

    async def _submit(
        self, route: Route, request: Request, timeout_s: float, timeout_message: str
    ) -> Result:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Result] = loop.create_future()
        self.waiting[request.id] = future
        self._outbox[route].append(request)
        if not self._flush_scheduled:
            # a task starts on the loop's next turn, after every request of this turn joined
            self._flush_scheduled = True
            task = asyncio.create_task(self._flush())
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        slot = f"{route.model}:{request.version}"
        self.inflight[slot] += 1
        # a bare timer instead of asyncio.wait_for: same effect, a fraction of the cost
        timer = loop.call_later(timeout_s, _expire, future, timeout_message)
        try:
            return await future
        finally:
            timer.cancel()
            self.waiting.pop(request.id, None)
            self.inflight[slot] -= 1

    def cancel(self, model: str, request_id: str) -> None:
        """The client went away: stop waiting, and tell the workers not to run it."""
        future = self.waiting.get(request_id)
        if future is None or future.done():
            return
        future.set_exception(Cancelled("Request was cancelled: the client disconnected"))
        task = asyncio.ensure_future(self.redis.publish(keys.cancel_channel(model), request_id))
        task.add_done_callback(_ignore_failure)

    async def _flush(self) -> None:
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, defaultdict(list)
        commands: list[Command] = []
        bounded: list[list[Request]] = []
        for route, requests in outbox.items():
            stream = keys.request_stream(route.model, route.level)
            if route.max_queue_size:
                # one entry per request, so that the size limit admits or refuses each
                args: list[int | bytes] = [route.level, route.max_queue_size]
                for request in requests:
                    entry = encode_requests([request])
                    args += [entry["h"], entry["d"]]
                commands.append(
                    self._enqueue.command([stream, keys.queue_sizes(route.model)], args)
                )
                bounded.append(requests)
                continue
            for start in range(0, len(requests), route.max_per_entry):
                commands.append(
                    xadd(stream, encode_requests(requests[start : start + route.max_per_entry]))
                )
        self.idle_poll.arm()
        try:
            replies = await self._sends.execute(*commands)
        except REDIS_ERRORS as exc:
            self._fail([r for rs in outbox.values() for r in rs], f"queue unavailable: {exc}")
            return
        admitted = iter(reply for reply in replies if isinstance(reply, list))
        for requests in bounded:
            for request, ok in zip(requests, next(admitted), strict=True):
                if not ok:
                    self._fail([request], f"[request id: {request.id}] Exceeds maximum queue size")

    def _fail(self, requests: list[Request], message: str) -> None:
        error = Unavailable(message)
        for request in requests:
            future = self.waiting.get(request.id)
            if future is not None and not future.done():
                future.set_exception(error)

    async def read_replies(self) -> None:
        """Resolve waiters from the reply stream until cancelled; survives Redis outages."""
        last_id = b"0-0"
        unread_trim = 0
        backoff = 0.05
        server = await self._server_identity()
        while True:
            try:
                if unread_trim >= TRIM_EVERY_ENTRIES:
                    await self.reader.xtrim(self.reply_stream, minid=last_id, approximate=False)
                    unread_trim = 0
                reply = await self._reads.call(
                    *("XREAD", "COUNT", 256, "BLOCK", REPLY_READ_BLOCK_MS),
                    *("STREAMS", self.reply_stream, last_id),
                )
            except REDIS_ERRORS as exc:
                if backoff == 0.05:
                    log.warning("reply stream read failed (%s); reconnecting", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            if backoff != 0.05:
                backoff = 0.05
                server = await self._after_outage(server)
            for _stream, entries in stream_entries(reply):
                for entry_id, fields in entries:
                    last_id = entry_id
                    unread_trim += 1
                    self._resolve(fields)
            if reply:
                self.idle_poll.arm()
                # the resolved requests' answers go out before the next read is sent: that
                # write wakes Redis, and at low load it would hold up the clients' replies
                await asyncio.sleep(0)

    async def _server_identity(self) -> tuple[str, bool] | None:
        """(run id, whether it persists writes): tells a restart that lost the queue."""
        try:
            info = await server_info(self.reader, self.reply_stream, "server")
            persistence = await server_info(self.reader, self.reply_stream, "persistence")
        except REDIS_ERRORS:
            return None
        return str(info.get("run_id")), bool(int(persistence.get("aof_enabled", 0)))

    async def _after_outage(self, before: tuple[str, bool] | None) -> tuple[str, bool] | None:
        now = await self._server_identity()
        if before is not None and now is not None and now[0] != before[0] and not now[1]:
            error = Unavailable("Redis restarted without persistence and lost this request; retry")
            log.error(
                "Redis restarted without persistence: failing %d waiting requests",
                len(self.waiting),
            )
            for future in self.waiting.values():
                if not future.done():
                    future.set_exception(error)
        return now

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
        self.idle_poll.stop()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
        await self._sends.close()
        await self._reads.close()
