"""Streamed responses: zero or more per request, the last one final, then the request's ack.

A decoupled model (Triton's `model_transaction_policy { decoupled: true }`) answers a request
as often as it likes, from any thread, even after its `execute` returned; a scheduler that
runs sequences iteration by iteration answers each of them once per step. Both hand their
responses to one `ResponseStream` per model queue, which numbers each request's responses
0, 1, 2, ... and publishes them in the order sent, many to a round trip, to the request's
reply route. The request's stream entry is acknowledged only with its final response: a worker
that dies mid-stream leaves it pending, and another worker takes it over and runs it again
from its start; the gateway then skips the responses it already delivered (by number).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sluice.shared.errors import SluiceError
from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import Request, ResponseParameter, Result, Tensor
from sluice.workers.answers.publisher import Publisher
from sluice.workers.batching.pending import Queued
from sluice.workers.instances.stacked import output_tensor

#: a streamed response's outputs by name, as a model hands them over.
Outputs = Mapping[str, np.ndarray | torch.Tensor]


class StreamClosed(RuntimeError):
    """A response for a request that is not open: never started here, or already final."""


@dataclass(slots=True)
class _Open:
    item: Queued
    next_seq: int = 0
    cancelled: bool = False


class ResponseStream:
    """The streamed responses of one model queue's requests.

    `open` (on the event loop) before a request runs; then `send` from any thread, in the
    order the responses are to arrive, the last one with `final=True`. `is_cancelled` tells
    a model that its client went away (it should stop, and must still send the final
    response, which frees the request)."""

    def __init__(self, publisher: Publisher, spec: ModelSpec) -> None:
        self.publisher = publisher
        #: output name -> datatype, from the config: what a response's outputs are sent as.
        self.output_types = {io.name: io.datatype for io in spec.outputs}
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        #: responses sent and not yet handed to the publisher, in the order sent.
        self._outbox: list[tuple[Queued, Result]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flusher: asyncio.Task[None] | None = None
        #: set while no request is open and nothing is left to publish.
        self._idle = asyncio.Event()
        self._idle.set()

    def open(self, items: Sequence[Queued]) -> None:
        """Start streaming `items`' responses (call on the event loop, before they run)."""
        self._loop = asyncio.get_running_loop()
        with self._lock:
            for item in items:
                self._open.setdefault(item.request.id, _Open(item))
        if items:
            self._idle.clear()

    def is_open(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._open

    def is_cancelled(self, request_id: str) -> bool:
        """Whether the request's client went away (False once the request is final)."""
        with self._lock:
            state = self._open.get(request_id)
            return state is not None and state.cancelled

    def cancel(self, request_id: str) -> bool:
        """The request's client went away: True if it is open here (its model is told)."""
        with self._lock:
            state = self._open.get(request_id)
            if state is not None:
                state.cancelled = True
            return state is not None

    def send(
        self,
        request: Request,
        outputs: Outputs | None = None,
        error: SluiceError | None = None,
        final: bool = False,
    ) -> None:
        """One response of `request` (any thread): `outputs` (those the request asked for are
        sent, as the config's datatypes), or an `error`, or neither (a flag-only final)."""
        wanted = self.output_types if request.outputs is None else request.outputs
        tensors = [
            output_tensor(name, self.output_types[name], value)
            for name, value in (outputs or {}).items()
            if name in wanted and name in self.output_types
        ]
        self.send_tensors(request, tensors, error, final)

    def send_tensors(
        self,
        request: Request,
        tensors: Sequence[Tensor],
        error: SluiceError | None = None,
        final: bool = False,
        parameters: dict[str, ResponseParameter] | None = None,
    ) -> None:
        """`send` with the outputs already wire tensors (and the response's `parameters` for
        its client). StreamClosed if the request is not open (never opened here, or its final
        response was sent)."""
        with self._lock:
            state = self._open.get(request.id)
            if state is None:
                raise StreamClosed(f"request {request.id} has no open response stream")
            seq, state.next_seq = state.next_seq, state.next_seq + 1
            if final:
                del self._open[request.id]
            failure = None if error is None else (error.code, error.message)
            # copied: a model may reuse its buffers before the response is published
            owned = [Tensor(t.name, t.datatype, t.shape, bytes(t.data)) for t in tensors]
            result = Result(request.id, owned, failure, seq, final, parameters or None)
            self._outbox.append((state.item, result))
        loop = self._loop
        assert loop is not None, "send before open"
        loop.call_soon_threadsafe(self._kick)

    def end(self, request: Request, error: SluiceError) -> bool:
        """Answer `request` finally with `error` unless it was answered finally already (its
        model failed); True if it was still open."""
        try:
            self.send_tensors(request, [], error, final=True)
        except StreamClosed:
            return False
        return True

    def _kick(self) -> None:
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Publish what was sent, in order, everything sent meanwhile in one round trip."""
        try:
            while True:
                with self._lock:
                    batch, self._outbox = self._outbox, []
                    if not batch:
                        if not self._open:
                            self._idle.set()
                        return
                await self.publisher.publish([q for q, _ in batch], [r for _, r in batch])
        finally:
            self._flusher = None

    async def wait_closed(self) -> None:
        """Until every open request was answered finally and published (a stopping queue
        waits for its models' streams; the worker's drain deadline bounds the wait)."""
        await self._idle.wait()
