"""Requests out to the model streams, results back from this gateway's reply stream.

Requests that arrive in the same event-loop turn go to Redis as one entry per model in one
round trip (gateway/outbox.py); one reader task resolves every waiter from the reply stream
(gateway/replies.py). Redis work per request is therefore O(1) and shrinks as load grows.

While Redis is unreachable, requests are held and sent once it answers again, all of them
again after a restart (gateway/outage.py): a request may then run twice, but its id is
resolved once, so its client gets one answer.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter, defaultdict
from collections.abc import AsyncGenerator, Callable, Iterable
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from sluice.gateway.outage import RETRY_AFTER_S, Outage, OutagePolicy
from sluice.gateway.outbox import Route, outbox_commands
from sluice.gateway.preserve_ordering import ReleaseOrder
from sluice.gateway.replies import ReplyReader
from sluice.gateway.response_order import ResponseOrder
from sluice.shared import keys
from sluice.shared.errors import Cancelled, InvalidInput, SluiceError, Unavailable
from sluice.shared.idle_poll import DEFAULT_WINDOW_US, IdlePoll
from sluice.shared.partitions import Dealer
from sluice.shared.protocol import ENCODING_ERRORS, Request, Result, encoding_problem
from sluice.shared.redis_client import (
    CONNECTION_ERRORS,
    REDIS_ERRORS,
    redis_failure,
    server_info,
)
from sluice.shared.redis_wire import Wire
from sluice.shared.sequence_controls import SEQUENCE_ID
from sluice.shared.sequence_routing import route_error

log = logging.getLogger(__name__)


def _wake_stream(order: ResponseOrder, future: asyncio.Future[Result]) -> None:
    """A stream's request ended: wake its reader. A failure is marked as seen here, since a
    reader that left first (a client gone, then cancelled) never asks for it."""
    if not future.cancelled():
        future.exception()
    order.wake.set()


def _unread(limit: int) -> str:
    return (
        f"request stopped: its client has not read its responses, and more than {limit} bytes "
        "of them were waiting (--stream-max-held-bytes)"
    )


def _ignore_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


#: a streamed request's responses held at most for a client that does not read them.
DEFAULT_STREAM_MAX_HELD_BYTES = 64 << 20


class Dispatcher:
    def __init__(
        self,
        redis: aioredis.Redis,
        reader: aioredis.Redis,
        gateway_id: str,
        idle_poll_us: int = DEFAULT_WINDOW_US,
        outage: OutagePolicy | None = None,
        clock_s: Callable[[], float] = time.monotonic,
        stream_max_held_bytes: int = DEFAULT_STREAM_MAX_HELD_BYTES,
    ) -> None:
        self.redis = redis
        #: bytes of one streamed request's responses held for its client (ResponseOrder).
        self.stream_max_held_bytes = stream_max_held_bytes
        self.outage: Outage[Route] = Outage(self, outage or OutagePolicy(), clock_s)
        #: the hot path's commands on connections of their own: sends, and the reply read.
        self._sends = Wire(redis, self.outage.check_server)
        self._reads = Wire(reader, self.outage.check_server)
        self.reply_stream = keys.reply_stream(gateway_id)
        self.waiting: dict[str, asyncio.Future[Result]] = {}
        #: streamed requests (see `stream`): their responses so far, put in order.
        self.streams: dict[str, ResponseOrder] = {}
        #: what each waiting request was sent as, to send it again after a Redis restart.
        self._sent: dict[str, tuple[Route, Request]] = {}
        self._clock_s = clock_s
        self._prefix = gateway_id
        self._ids = itertools.count()
        self._outbox: dict[Route, list[Request]] = defaultdict(list)
        #: which partition the next entry of each model and level goes to.
        self.dealer = Dealer()
        self._flush_scheduled = False
        self._sending: set[asyncio.Task[None]] = set()
        #: "model:version" -> requests sent and not yet answered.
        self.inflight: Counter[str] = Counter()
        self._ordered = ReleaseOrder()
        #: with one request in flight, poll for its reply and the client's next request
        self.idle_poll = IdlePoll(idle_poll_us * 1000, lambda: len(self.waiting) <= 1)
        #: resolves the waiters from the reply stream: its `run` is the gateway's reader task.
        self.replies = ReplyReader(
            reader,
            self._reads,
            self.reply_stream,
            self.outage,
            self.waiting,
            self.streams,
            self.idle_poll,
        )

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
        answer = self._submit(route, request, timeout_s, timeout_message)
        if not preserve_ordering:
            return await answer
        return await self._ordered.released(route.model, answer)

    async def _submit(
        self, route: Route, request: Request, timeout_s: float, timeout_message: str
    ) -> Result:
        loop = asyncio.get_running_loop()
        future = self._queue(route, request)
        slot = f"{route.model}:{request.version}"
        self.inflight[slot] += 1
        # a bare timer instead of asyncio.wait_for: same effect, a fraction of the cost
        timer = loop.call_later(timeout_s, self._time_out, future, timeout_message)
        try:
            return await future
        finally:
            timer.cancel()
            self.waiting.pop(request.id, None)
            self._sent.pop(request.id, None)
            self.inflight[slot] -= 1

    def _queue(self, route: Route, request: Request) -> asyncio.Future[Result]:
        """Put `request` in the outbox; the future its one answer resolves."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self.waiting[request.id] = future
        self._sent[request.id] = (route, request)
        self._outbox[route].append(request)
        if not self._flush_scheduled:
            # a task starts on the loop's next turn, after every request of this turn joined
            self._flush_scheduled = True
            task = asyncio.create_task(self._flush())
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        return future

    async def stream(
        self,
        route: Route,
        request: Request,
        timeout_s: float,
        timeout_message: str = "Request timeout expired",
    ) -> AsyncGenerator[Result, None]:
        """Queue `request` and yield its responses in order, each once, until the final one
        (a decoupled model's zero or more; an ordinary model's one answer). `timeout_s` bounds
        the wait for each response. Leaving before the final response cancels the request, and
        so does a consumer that lets more than `stream_max_held_bytes` of them wait."""
        loop = asyncio.get_running_loop()
        stop = partial(self._tell_workers, route.model, request.id)
        order = ResponseOrder(self.stream_max_held_bytes, stop)
        self.streams[request.id] = order
        future = self._queue(route, request)
        future.add_done_callback(partial(_wake_stream, order))
        slot = f"{route.model}:{request.version}"
        self.inflight[slot] += 1
        ended = False
        try:
            while True:
                timer = loop.call_later(timeout_s, self._time_out, future, timeout_message)
                try:
                    await order.wake.wait()
                finally:
                    timer.cancel()
                order.wake.clear()
                if order.overflowed:
                    raise Unavailable(_unread(self.stream_max_held_bytes))
                while order.ready:
                    response = order.take()
                    ended = response.final
                    yield response
                    if ended:
                        return
                if future.done():  # answered at once (refused, expired), failed, or cancelled
                    ended = True
                    yield future.result()
                    return
        finally:
            if not ended and not order.overflowed:  # its consumer left, or it timed out or failed
                stop()
            self.streams.pop(request.id, None)
            self.waiting.pop(request.id, None)
            self._sent.pop(request.id, None)
            self.inflight[slot] -= 1

    def _time_out(self, future: asyncio.Future[Result], message: str) -> None:
        if not future.done():
            retry_after_s = None if self.outage.since_s is None else RETRY_AFTER_S
            future.set_exception(Unavailable(message, retry_after_s))

    def abandon(self, model: str, error: Exception) -> None:
        """Fail the requests still waiting on `model`, which no worker serves any more (it was
        unloaded everywhere after they were sent): they get `error`, not a timeout."""
        for request_id, (route, _) in list(self._sent.items()):
            future = self.waiting.get(request_id)
            if route.model == model and future is not None and not future.done():
                future.set_exception(error)

    def cancel(self, model: str, request_id: str) -> None:
        """The client went away: stop waiting, and tell the workers not to run it."""
        future = self.waiting.get(request_id)
        if future is None or future.done():
            return
        future.set_exception(Cancelled("Request was cancelled: the client disconnected"))
        self._tell_workers(model, request_id)

    def _tell_workers(self, model: str, request_id: str) -> None:
        """Publish the cancellation: the worker drops it if queued, tells its model if it
        streams."""
        task = asyncio.ensure_future(self.redis.publish(keys.cancel_channel(model), request_id))
        task.add_done_callback(_ignore_failure)

    async def _flush(self) -> None:
        """Send the outbox, and again whatever joined it while that send was out: one send in
        flight at a time, so requests that arrive during a round trip share the next entry
        (fewer, fuller stream entries and fewer wakeups of Redis and the workers under load;
        a lone request goes out at once as before)."""
        while True:
            outbox, self._outbox = self._outbox, defaultdict(list)
            error = None
            if self.outage.since_s is None:
                self.idle_poll.arm()
                try:
                    error = await self.send_outbox(outbox)
                except Exception as exc:  # a bug: these requests fail, the flushing goes on
                    log.error("requests not queued", exc_info=exc)
                    sent = (r for requests in outbox.values() for r in requests)
                    self._fail_with(sent, SluiceError(f"request not queued: {exc!r}"))
                    error = None
                if error is None:
                    await asyncio.sleep(0)  # this turn's requests join the next send
                    if self._outbox:
                        continue
                    self._flush_scheduled = False
                    return
            self._flush_scheduled = False
            self.outage.begin(error)
            now_s = self._clock_s()
            self.outage.hold(
                (route, r, now_s) for route, requests in outbox.items() for r in requests
            )
            return

    async def send_outbox(self, outbox: dict[Route, list[Request]]) -> Exception | None:
        """Send `outbox` in one round trip; the connection error if Redis did not answer.
        A command Redis refused fails its own requests (OutOfMemory when for memory); the
        others were queued."""
        try:
            sends = outbox_commands(outbox, self.dealer)
        except ENCODING_ERRORS:  # a request the wire cannot carry: it fails, the others go
            sends = outbox_commands(self._encodable(outbox), self.dealer)
        try:
            replies = await self._sends.execute(
                *(send.command for send in sends), raise_on_error=False
            )
        except CONNECTION_ERRORS as exc:
            return exc
        except REDIS_ERRORS as exc:
            self._refuse((r for send in sends for r in send.requests), exc)
            return None
        for send, reply in zip(sends, replies, strict=True):
            if isinstance(reply, Exception):
                self._refuse(send.requests, reply)
            elif send.sequenced:
                self._routed(send.requests[0], reply)
            elif send.bounded:
                for request, ok in zip(send.requests, reply, strict=True):
                    if not ok:
                        message = f"[request id: {request.id}] Exceeds maximum queue size"
                        self.fail([request], message)
        return None

    def _encodable(self, outbox: dict[Route, list[Request]]) -> dict[Route, list[Request]]:
        """`outbox` less the requests that cannot be encoded, which fail with the reason."""
        kept: dict[Route, list[Request]] = defaultdict(list)
        for route, requests in outbox.items():
            for request in requests:
                problem = encoding_problem(request)
                if problem is None:
                    kept[route].append(request)
                else:
                    self._fail_with([request], InvalidInput(problem))
        return kept

    def _routed(self, request: Request, reply: Any) -> None:
        """A sequence's request was queued for its owner, or refused for the reason its routing
        script gives (shared/sequence_routing.py)."""
        sent = self._sent.get(request.id)
        if sent is None:  # it timed out meanwhile
            return
        error = route_error(sent[0].model, request.parameters[SEQUENCE_ID], reply)
        if error is not None:
            self._fail_with([request], error)

    def _refuse(self, requests: Iterable[Request], exc: Exception) -> None:
        """Redis refused the command that carried `requests`: none of them was queued."""
        self._fail_with(requests, redis_failure(exc, "request not queued", "queue unavailable"))

    def fail(
        self, requests: Iterable[Request], message: str, retry_after_s: int | None = None
    ) -> None:
        self._fail_with(requests, Unavailable(message, retry_after_s))

    def _fail_with(self, requests: Iterable[Request], error: Exception) -> None:
        for request in requests:
            future = self.waiting.get(request.id)
            if future is not None and not future.done():
                future.set_exception(error)

    def still_waiting(self, request_id: str) -> bool:
        future = self.waiting.get(request_id)
        return future is not None and not future.done()

    def unanswered(self) -> list[tuple[Route, Request]]:
        queued = {request.id for requests in self._outbox.values() for request in requests}
        return [sent for request_id, sent in self._sent.items() if request_id not in queued]

    async def ping(self) -> None:
        await self._sends.call("PING")

    async def server_identity(self) -> str | None:
        """The run id of the Redis server: a new one means a restart that may have lost writes."""
        try:
            info = await server_info(self.redis, self.reply_stream, "server")
        except REDIS_ERRORS:
            return None
        return str(info.get("run_id"))

    def inflight_snapshot(self) -> dict[str, int]:
        return {slot: n for slot, n in self.inflight.items() if n}

    async def close(self) -> None:
        self.idle_poll.stop()
        await self.outage.close()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
        await self._sends.close()
        await self._reads.close()
