"""BLS: a Python model's own infer requests, sent through the target model's Redis stream like
any gateway's, so that any worker of the fleet serving the target may run them.

The client is the worker's, made on first use: a private thread runs its event loop, with
Redis connections of its own, and every call waits on a future of that loop. So `exec()`
blocks only its caller (an instance's thread, or an async `execute`'s loop), never the
worker's event loop, which goes on reading and answering the target's requests when this
worker serves it too. Results come back on a reply stream of the client's own; the target's
config (priority levels, queue size limit) is read from the model records in Redis.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sluice.shared import keys
from sluice.shared.admission import enqueue_command, queue_full
from sluice.shared.config_view import ConfigView
from sluice.shared.errors import ModelExecutionError, SluiceError, Unavailable
from sluice.shared.protocol import (
    ProtocolError,
    Request,
    Result,
    Tensor,
    encode_requests,
    settle_results,
)
from sluice.shared.redis_client import REDIS_ERRORS, async_client, initialized
from sluice.shared.redis_wire import Wire, stream_entries, xadd
from sluice.shared.registry import ModelRecord
from sluice.shared.repository_control import decode_desired

log = logging.getLogger(__name__)

#: how long a call waits for its result when it set no timeout (the gateway's default).
DEFAULT_WAIT_S = 300.0
#: how long a target's record read from Redis is trusted.
RECORD_TTL_S = 1.0
REPLY_BLOCK_MS = 1000
TRIM_EVERY_ENTRIES = 64
#: how long closing waits for the client's loop to end.
CLOSE_WAIT_S = 5.0

_lock = threading.Lock()
_redis_url: str | None = None
_client: BlsClient | None = None


def use_redis(url: str) -> None:
    """Where this process's BLS calls go (the worker's Redis); set before the models run."""
    global _redis_url
    _redis_url = url


@dataclass(slots=True)
class BlsCall:
    """One BLS request: `version` 0 is the target's latest."""

    model: str
    version: int
    inputs: list[Tensor]
    outputs: tuple[str, ...] | None
    parameters: dict[str, Any] = field(default_factory=dict)
    wait_s: float = DEFAULT_WAIT_S
    #: the calling request's trace context (`trace=request.trace()`): the call joins it.
    traceparent: str | None = None


class StreamedResults:
    """A decoupled call's results in the order the target sent them, the last one final (a
    failure is one final result with an error); filled by the client's loop, read from any
    thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Result] = queue.SimpleQueue()
        #: done once the final result is in.
        self.finished: concurrent.futures.Future[None] = concurrent.futures.Future()

    def put(self, result: Result) -> None:
        self._queue.put(result)
        if result.final and not self.finished.done():
            self.finished.set_result(None)

    def __iter__(self) -> Iterator[Result]:
        """Each result as it comes (blocking), up to the final one."""
        while True:
            result = self._queue.get()
            yield result
            if result.final:
                return


def submit(call: BlsCall) -> concurrent.futures.Future[Result]:
    """The call's result (a Result with an error when it failed: never an exception)."""
    return _shared_client().submit(call)


def submit_streamed(call: BlsCall) -> StreamedResults:
    """A call to a decoupled model: every response it sends, as it sends them."""
    return _shared_client().submit_streamed(call)


def is_ready(model: str, version: int) -> bool:
    """Whether `model` (its `version`; 0: its latest) is ready somewhere in the fleet."""
    return _shared_client().is_ready(model, version)


def forget_records() -> None:
    """Read the models' records afresh on the next calls (a model was just loaded or
    unloaded, an ensemble's steps with it)."""
    with _lock:
        client = _client
    if client is not None:
        client.forget_records()


def _shared_client() -> BlsClient:
    global _client
    with _lock:
        if _client is None:
            if _redis_url is None:
                raise RuntimeError("BLS is only available inside a sluice worker")
            _client = BlsClient(_redis_url)
            atexit.register(_client.close)
        return _client


@dataclass(slots=True)
class _Stream:
    results: StreamedResults
    #: the next response number expected: a worker that took the request over after another
    #: died mid-stream sends the first ones again.
    next_seq: int = 0


@dataclass(slots=True)
class _Target:
    #: None: unknown or not ready.
    config: ConfigView | None
    versions: list[int]
    read_at_s: float


class BlsClient:
    """The calls of one process, on a loop of their own (see the module's docstring)."""

    def __init__(self, redis_url: str) -> None:
        self._url = redis_url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bls", daemon=True)
        self._thread.start()
        member = f"bls-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._prefix = member
        self._ids = itertools.count()
        self.reply_stream = keys.reply_stream(member)
        self._waiting: dict[str, asyncio.Future[Result]] = {}
        self._streams: dict[str, _Stream] = {}
        self._targets: dict[str, _Target] = {}
        self._redis: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._connected: asyncio.Future[None] | None = None

    def submit(self, call: BlsCall) -> concurrent.futures.Future[Result]:
        request_id = f"{self._prefix}:{next(self._ids)}"
        return asyncio.run_coroutine_threadsafe(self._call(request_id, call), self._loop)

    def submit_streamed(self, call: BlsCall) -> StreamedResults:
        results = StreamedResults()
        request_id = f"{self._prefix}:{next(self._ids)}"
        asyncio.run_coroutine_threadsafe(self._streamed(request_id, call, results), self._loop)
        return results

    async def _streamed(self, request_id: str, call: BlsCall, results: StreamedResults) -> None:
        """Responses go to `results` as they come (`_on_streamed`); a target that is not
        decoupled answers once, and a failure is one error: either is the final result."""
        self._streams[request_id] = _Stream(results)
        try:
            last = await self._call(request_id, call)
        except asyncio.CancelledError:
            results.put(Result(request_id, error=("UNAVAILABLE", "the BLS client closed")))
            raise
        finally:
            del self._streams[request_id]
        if last.seq is None:
            results.put(last)

    def _on_streamed(self, result: Result) -> None:
        stream = self._streams.get(result.id)
        if stream is None or result.seq is None or result.seq < stream.next_seq:
            return
        stream.next_seq = result.seq + 1
        stream.results.put(result)
        answer = self._waiting.get(result.id)
        if result.final and answer is not None and not answer.done():
            answer.set_result(result)

    async def _call(self, request_id: str, call: BlsCall) -> Result:
        try:
            return await self._infer(request_id, call)
        except SluiceError as exc:
            return Result(request_id, error=(exc.code, exc.message))
        except REDIS_ERRORS as exc:
            return Result(request_id, error=("UNAVAILABLE", f"queue unavailable: {exc}"))

    async def _connect(self) -> None:
        if self._connected is None:
            self._redis = async_client(self._url)
            self._connected = asyncio.ensure_future(initialized(self._redis))
            self._reader = asyncio.create_task(self._read_replies())
        await self._connected  # before this call and the others use the client together

    def forget_records(self) -> None:
        """Drop the cached records (before any call made after this one reads them)."""
        self._loop.call_soon_threadsafe(self._targets.clear)

    def is_ready(self, model: str, version: int) -> bool:
        """Whether the fleet serves `model` (its `version`; 0: any), as its record says."""
        return asyncio.run_coroutine_threadsafe(self._is_ready(model, version), self._loop).result()

    async def _is_ready(self, model: str, version: int) -> bool:
        await self._connect()
        target = await self._target(model)
        return target.config is not None and (not version or version in target.versions)

    async def _infer(self, request_id: str, call: BlsCall) -> Result:
        await self._connect()
        target = await self._target(call.model)
        failed = f"Model {call.model} - Error when running inference: "  # Triton's prefix
        if target.config is None or (call.version and call.version not in target.versions):
            # Triton's text for an unknown, unready or missing version alike
            raise ModelExecutionError(
                f"{failed}Failed for execute the inference request. Model '{call.model}' is "
                "not ready."
            )
        if request_id not in self._streams and target.config.decoupled:
            raise ModelExecutionError(
                f"{failed}Model {call.model} is using the decoupled. The current BLS request "
                "call doesn't support models using the decoupled transaction policy. Please "
                "use 'decoupled=True' argument to the 'exec' or 'async_exec' calls for "
                "decoupled models.'"
            )
        policy = target.config.queue_policy
        level = policy.level_of(call.parameters)
        request = Request(
            request_id,
            call.version,
            time.time_ns(),
            self.reply_stream,
            call.inputs,
            call.outputs,
            call.parameters,
            traced=call.traceparent is not None,
            traceparent=call.traceparent,
            model_span=True,
        )
        answer: asyncio.Future[Result] = self._loop.create_future()
        self._waiting[request_id] = answer
        try:
            await self._send(call.model, level, policy.for_level(level).max_queue_size, request)
            return await asyncio.wait_for(answer, call.wait_s)
        except TimeoutError:
            await self._redis.publish(keys.cancel_channel(call.model), request_id)
            raise Unavailable("Request timeout expired") from None
        finally:
            self._waiting.pop(request_id, None)

    async def _send(self, model: str, level: int, max_queue_size: int, request: Request) -> None:
        entry = encode_requests([request])
        if not max_queue_size:
            await self._redis.execute_command(*xadd(keys.request_stream(model, level), entry))
            return
        admitted = await self._redis.execute_command(
            *enqueue_command(model, level, max_queue_size, [entry])
        )
        if not admitted or not admitted[0]:
            raise Unavailable(queue_full(request.id))

    async def _target(self, model: str) -> _Target:
        """The model's record, as every gateway's model table reads it: a model unloaded on
        purpose is not ready from its unload on, while its workers finish it."""
        now_s = time.monotonic()
        known = self._targets.get(model)
        if known is not None and now_s - known.read_at_s < RECORD_TTL_S:
            return known
        raw = await self._redis.hget(keys.MODELS, model)
        record = ModelRecord.decode(raw) if raw is not None else None
        wanted = await self._redis.hget(keys.DESIRED, model)
        if record is None or (wanted is not None and not decode_desired(wanted).loaded):
            target = _Target(None, [], now_s)
        else:
            target = _Target(record.config, record.versions, now_s)
        self._targets[model] = target
        return target

    async def _read_replies(self) -> None:
        reader = async_client(self._url, socket_timeout_s=None)
        reads = Wire(reader)  # on a cluster, straight to the stream's node
        last_id: bytes | str = "0-0"
        unread_trim = 0
        try:
            while True:
                try:
                    if unread_trim >= TRIM_EVERY_ENTRIES:
                        await reader.xtrim(self.reply_stream, minid=last_id, approximate=True)
                        unread_trim = 0
                    reply = await reads.call(
                        *("XREAD", "COUNT", 256, "BLOCK", REPLY_BLOCK_MS),
                        *("STREAMS", self.reply_stream, last_id),
                    )
                except REDIS_ERRORS as exc:
                    log.warning("BLS reply stream read failed (%s); retrying", exc)
                    await asyncio.sleep(0.1)
                    continue
                for _stream, entries in stream_entries(reply):
                    for entry_id, fields in entries:
                        last_id, unread_trim = entry_id, unread_trim + 1
                        self._resolve(fields)
        finally:
            await reads.close()
            await reader.aclose()

    def _resolve(self, fields: Any) -> None:
        try:
            settle_results(fields, self._waiting, self._on_streamed)
        except ProtocolError as exc:
            log.error("undecodable BLS reply entry: %s", exc)

    def close(self) -> None:
        """Stop the loop; the reply stream goes with it."""
        if not self._thread.is_alive():
            return
        done = asyncio.run_coroutine_threadsafe(self._aclose(), self._loop)
        try:
            done.result(timeout=CLOSE_WAIT_S)
        except (TimeoutError, *REDIS_ERRORS) as exc:  # best effort at exit
            log.warning("BLS client did not close cleanly: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_WAIT_S)
        if not self._thread.is_alive():
            self._loop.close()

    async def _aclose(self) -> None:
        """Calls still waiting are cancelled (their callers get CancelledError), then the
        reply reader, then the connections."""
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        if self._redis is not None:
            await self._redis.delete(self.reply_stream)
            await self._redis.aclose()
