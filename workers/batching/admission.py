"""Turning read stream entries into queued requests: decode, validate, place, or reject.

Each request is checked on its own before it joins the queue, so a bad one becomes its own
error result and never fails a batch. A request cancelled before this worker read it is
dropped when it arrives.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from sluice.shared.errors import InvalidInput, SluiceError
from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import ProtocolError, Request, Result, decode_requests
from sluice.shared.queue_policy import deadline_us
from sluice.shared.redis_wire import stream_entries
from sluice.shared.signature import validate_inputs
from sluice.workers.batching.answering import Answering
from sluice.workers.batching.batcher import Pending
from sluice.workers.batching.pending import Queued
from sluice.workers.batching.queue_state import QueueState
from sluice.workers.instances.lanes import Instances

log = logging.getLogger(__name__)

#: how many cancelled-but-unread request ids a worker remembers.
CANCELLED_MEMORY = 10_000

#: a request refused before it was queued, with its error result.
Rejected = tuple[Queued, Result]


class Admission:
    """Queues one model's requests as they are read, or names why not."""

    def __init__(
        self,
        spec: ModelSpec,
        streams: dict[str, int],
        instances: Instances,
        state: QueueState,
        answering: Answering,
    ) -> None:
        self.spec = spec
        self.signature = spec.config.signature
        self.policy = spec.config.queue_policy
        #: stream name -> priority level.
        self.streams = streams
        self.instances = instances
        self.state = state
        self.answering = answering
        self._seq = itertools.count()
        #: ids cancelled before this worker read them (insertion-ordered, bounded).
        self._cancelled: dict[str, None] = {}

    def remember_cancelled(self, request_id: str) -> None:
        """A cancellation for a request not read yet: drop it when it is."""
        self._cancelled[request_id] = None
        if len(self._cancelled) > CANCELLED_MEMORY:
            del self._cancelled[next(iter(self._cancelled))]

    def admit_reply(self, reply: Any, now_ns: int) -> list[Rejected]:
        """Queue the requests of an XREADGROUP reply; return the ones rejected."""
        rejected: list[Rejected] = []
        for raw_stream, entries in stream_entries(reply):
            stream = raw_stream.decode() if isinstance(raw_stream, bytes) else raw_stream
            for entry_id, fields in entries:
                rejected += self._admit(stream, entry_id, fields, now_ns)
        return rejected

    def _admit(
        self, stream: str, entry_id: bytes, fields: dict[bytes, bytes], now_ns: int
    ) -> list[Rejected]:
        try:
            requests = decode_requests(fields)
        except ProtocolError as exc:
            log.error("%s: dropping undecodable entry %r: %s", self.spec.name, entry_id, exc)
            self.answering.spawn(
                self.answering.publisher.publish([], [], extra_acks=[(stream, entry_id)])
            )
            return []
        return self.queue(stream, entry_id, requests, now_ns, alone=False)

    def queue(
        self, stream: str, entry_id: bytes, requests: Sequence[Request], now_ns: int, alone: bool
    ) -> list[Rejected]:
        """Hold the entry until its requests are answered and queue each one (`alone`: taken
        over from a dead worker, so each runs in a batch of its own)."""
        self.answering.publisher.hold(stream, entry_id, len(requests))
        level = self.streams[stream]
        rejected = []
        for request in requests:
            item = Queued(request, stream, entry_id, Pending(None, 1, 0), level, next(self._seq))
            if request.traced:
                item.read_ns = now_ns
            if request.id in self._cancelled:
                del self._cancelled[request.id]
                self.answering.spawn(self.answering.drop_cancelled(item))
                continue
            try:
                self._prepare(item, now_ns, alone)
            except SluiceError as exc:
                rejected.append((item, Result(request.id, error=(exc.code, exc.message))))
                continue
            self.state.queued(item)
        return rejected

    def _prepare(self, item: Queued, now_ns: int, alone: bool) -> None:
        """Validate the request and work out its batch group, size and deadlines."""
        request = item.request
        if request.version == 0:
            request.version = self.instances.default_version
        elif request.version not in self.instances.by_version:
            raise InvalidInput(f"model '{self.spec.name}' version {request.version} not served")
        size = validate_inputs(self.signature, request.inputs)
        batched = self.spec.max_batch_size > 0
        shapes = tuple(
            (t.name, t.shape[1:] if batched else t.shape)
            for t in sorted(request.inputs, key=lambda t: t.name)
        )
        group = ("alone", request.id) if alone else (request.version, shapes)
        start = min(request.enqueue_ns, now_ns)
        if not alone:
            self.state.arrived(start)
        item.pending = Pending(group, size, start)
        timeout_us = self.policy.queue_timeout_us(item.level, request.parameters)
        if timeout_us:
            item.timeout_at_ns = start + timeout_us * 1000
            item.reject_on_timeout = self.policy.for_level(item.level).timeout_action != "DELAY"
        limit_us = deadline_us(request.parameters)
        if limit_us:
            item.deadline_at_ns = start + limit_us * 1000
