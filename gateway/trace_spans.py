"""A traced request's spans at the gateway, in OpenTelemetry mode (`--trace-config
mode=opentelemetry`), shaped as tritonserver 2.51 exports them and with sluice's own beside.

As Triton: a root `InferRequest` span (under the client's `traceparent` when it sent one),
a span named after the model from REQUEST_START to REQUEST_END with Triton's attributes and
its timestamps as events, and under that the worker's `compute` span. sluice adds the gateway's
`decode`, `validate`, `reply read` and `respond` spans, and the worker its `queue`, `batch` and
`publish` spans (workers/batching/trace_spans.py), joined through the traceparent the request
carries in its stream entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.shared.otel import Exporting, span_events, traceparent_of

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span


@dataclass(slots=True)
class RequestSpans:
    """A request's open spans and the gateway's marks between them (wall-clock ns)."""

    root: Span
    model: Span
    #: the decode's and the checks' ends (0: the request failed before).
    decoded_ns: int = 0
    checked_ns: int = 0

    @property
    def traceparent(self) -> str:
        """What the worker's spans go under: the model's span."""
        return traceparent_of(self.model)


class GatewaySpans:
    def __init__(self, exporting: Exporting) -> None:
        self.exporting = exporting
        self.tracer = exporting.tracer

    def open(self, model: str, at_ns: int, parent: Context | None) -> RequestSpans:
        from opentelemetry.trace import SpanKind, set_span_in_context

        root = self.tracer.start_span("InferRequest", parent, SpanKind.SERVER, start_time=at_ns)
        inner = set_span_in_context(root)
        span = self.tracer.start_span(model, inner, SpanKind.SERVER, start_time=at_ns)
        return RequestSpans(root, span)

    def close(
        self,
        spans: RequestSpans,
        attributes: dict[str, str | int],
        stamps: list[tuple[str, int]],
        compute_end_ns: int | None,
        error: str | None,
    ) -> None:
        """The model's span ends at REQUEST_END (the last of `stamps`), with the gateway's
        spans under it: `reply read` from the model's end (`compute_end_ns`, the worker's
        clock) to the gateway holding the result."""
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        model = spans.model
        inner = set_span_in_context(model)
        start_ns, end_ns = stamps[0][1], stamps[-1][1]
        if spans.decoded_ns:
            self._span("decode", inner, start_ns, spans.decoded_ns)
        if spans.checked_ns:
            self._span("validate", inner, spans.decoded_ns, spans.checked_ns)
        if compute_end_ns is not None:
            self._span("reply read", inner, min(compute_end_ns, end_ns), end_ns)
        model.set_attributes(attributes)
        span_events(model, [s for s in stamps if not s[0].startswith("COMPUTE_")])
        if error is not None:
            model.set_status(Status(StatusCode.ERROR, error))
        model.end(end_time=end_ns)

    def respond(self, spans: RequestSpans, from_ns: int, at_ns: int, error: str | None) -> None:
        """The response is made: `respond` from REQUEST_END, and the root span ends."""
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        root = spans.root
        if error is None:
            self._span("respond", set_span_in_context(root), from_ns, at_ns)
            span_events(root, [("INFER_RESPONSE_COMPLETE", from_ns)])
        else:
            root.set_status(Status(StatusCode.ERROR, error))
        root.end(end_time=at_ns)

    def _span(self, name: str, parent: Context, start_ns: int, end_ns: int) -> None:
        self.tracer.start_span(name, parent, start_time=start_ns).end(end_time=end_ns)

    def close_exporter(self) -> None:
        self.exporting.close()
