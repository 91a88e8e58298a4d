"""A worker's spans of the traced requests in a batch, in OpenTelemetry mode, joined to their
gateway's trace through the traceparent each request carries in its stream entry.

Under the request's parent (the gateway's model span, or one this worker opens named after its
model for an ensemble step or a BLS call, as Triton opens one for each composing model): `queue`
(its wait in Redis, from the gateway's XADD to the worker's read), `batch` (from the read to its
answer published; the batch's size and its members' request ids as attributes, and links to the
traces of its other traced members), Triton's `compute` (COMPUTE_START to COMPUTE_END, its
timestamps as events) and `publish` (the answer's encoding and write).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.shared.otel import Exporting, context_of, span_events, traceparent_of
from sluice.shared.protocol import Request
from sluice.workers.batching.pending import Queued

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, Span

#: member request ids a batch span names (a batch's size is on it whole).
MAX_MEMBER_IDS = 64
COMPUTE = ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END")


@dataclass(slots=True)
class TracedRequest:
    """A traced request of a batch and the context its spans go under."""

    item: Queued
    parent: Context
    #: the span this worker opened for the request's model (ensemble step, BLS call).
    model: Span | None = None

    def link(self) -> Link:
        """A link to this request's trace, from another request's batch span."""
        from opentelemetry.trace import Link, get_current_span

        return Link(get_current_span(self.parent).get_span_context())


class WorkerSpans:
    def __init__(self, exporting: Exporting, model: str) -> None:
        self.tracer = exporting.tracer
        self.model = model

    def opened(self, batch: Sequence[Queued]) -> list[TracedRequest]:
        """The batch's requests traced in OpenTelemetry mode; a request that opens a span for
        its model has it started now, a BLS call's traceparent then that span's (for the BLS
        calls its model makes in turn)."""
        traced: list[TracedRequest] = []
        for item in batch:
            request = item.request
            if request.traceparent is None or item.filler:
                continue  # most batches: nothing traced, nothing more done
            parent = context_of(request.traceparent)
            if parent is None:
                continue
            record = TracedRequest(item, parent)
            if request.model_span:
                from opentelemetry.trace import SpanKind, set_span_in_context

                span = self.tracer.start_span(
                    self.model, parent, SpanKind.SERVER, start_time=request.enqueue_ns
                )
                record.model, record.parent = span, set_span_in_context(span)
                if request.continuation is None:  # an ensemble's next steps keep its parent
                    request.traceparent = traceparent_of(span)
            traced.append(record)
        return traced

    def answered(
        self,
        traced: list[TracedRequest],
        members: Sequence[Request],
        batch_size: int,
        compute: list[int],
        ran_ns: int,
        published_ns: int,
    ) -> None:
        """The batch's answers are published: each traced request's spans end."""
        ids = [r.id for r in members[:MAX_MEMBER_IDS]]
        attributes: dict[str, Any] = {
            "sluice.batch.size": batch_size,
            "sluice.batch.requests": len(members),
            "sluice.batch.request_ids": ids,
        }
        for record in traced:
            request = record.item.request
            read_ns = record.item.read_ns or compute[0]
            self._span("queue", record.parent, request.enqueue_ns, read_ns)
            links = [other.link() for other in traced if other is not record]
            self.tracer.start_span(
                "batch", record.parent, attributes=attributes, links=links, start_time=read_ns
            ).end(end_time=published_ns)
            computed = self.tracer.start_span("compute", record.parent, start_time=compute[0])
            span_events(computed, list(zip(COMPUTE, compute, strict=True)))
            computed.end(end_time=compute[-1])
            self._span("publish", record.parent, ran_ns, published_ns)
            if record.model is not None:
                stamps = [("REQUEST_START", request.enqueue_ns), ("QUEUE_START", read_ns)]
                span_events(record.model, [*stamps, ("REQUEST_END", published_ns)])
                record.model.set_attributes(
                    {"triton.model_name": self.model, "triton.model_version": request.version}
                )
                record.model.end(end_time=published_ns)

    def _span(self, name: str, parent: Context, start_ns: int, end_ns: int) -> None:
        self.tracer.start_span(name, parent, start_time=start_ns).end(end_time=end_ns)
