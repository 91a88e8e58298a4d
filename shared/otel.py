"""OpenTelemetry for `--trace-config mode=opentelemetry`: the tracer every gateway and worker
exports its spans with, and the W3C trace context a request carries between them.

The SDK and its OTLP/HTTP exporter do the exporting (the `otel` extra); its batch span
processor holds at most `bsp_max_queue_size` spans, dropping the rest, so a slow or absent
collector never grows a process's memory or slows a request. Spans are made with explicit
wall-clock times, so those a gateway and a worker make on different hosts line up as far as
their clocks agree, as Triton's do.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.shared.trace_settings import TraceSettings

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

#: Triton's resource default, so a dashboard that looks for its service finds sluice's spans.
SERVICE_NAME = "triton-inference-server"
#: the instrumentation scope Triton's spans carry.
SCOPE = "triton-server"
#: how long a stopping process waits for its last spans to be exported.
CLOSE_WAIT_S = 2.0
#: a W3C traceparent header (version 00): trace id, parent span id, flags; ids not all zero.
TRACEPARENT = re.compile(rb"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


class OtelMissing(RuntimeError):
    """mode=opentelemetry without the SDK installed."""


@dataclass(frozen=True, slots=True)
class Exporting:
    """A process's tracer and the provider that exports what it makes."""

    tracer: Tracer
    provider: TracerProvider

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Export what is held, then stop (a process's last spans are not lost), waiting at
        most `wait_s`: a collector that is down must not hold up a process that stops."""
        closing = threading.Thread(target=self.provider.shutdown, name="otel-close", daemon=True)
        closing.start()
        closing.join(wait_s)


def exporting(settings: TraceSettings, role: str) -> Exporting:
    """This process's tracer, exporting to `settings.url`; `role` (gateway, worker) joins the
    resource, so a trace shows which process made each span."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise OtelMissing(
            "--trace-config mode=opentelemetry needs the OpenTelemetry SDK: "
            "pip install 'sluice-serve[otel]'"
        ) from None
    attributes: dict[str, Any] = {"service.name": SERVICE_NAME, "sluice.role": role}
    for pair in settings.resource:
        key, _, value = pair.partition("=")
        attributes[key] = value
    url = settings.url if "://" in settings.url else f"http://{settings.url}"
    # closed by Exporting.close, bounded; the SDK's own close at exit would wait out retries
    provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
    processor = BatchSpanProcessor(
        OTLPSpanExporter(endpoint=url),
        max_queue_size=settings.bsp_max_queue_size,
        schedule_delay_millis=settings.bsp_schedule_delay,
        max_export_batch_size=min(settings.bsp_max_export_batch_size, settings.bsp_max_queue_size),
    )
    provider.add_span_processor(processor)
    return Exporting(provider.get_tracer(SCOPE), provider)


def context_of(traceparent: str | None) -> Context | None:
    """The context a span continues: a W3C `traceparent` (None when absent or malformed)."""
    if traceparent is None or not TRACEPARENT.fullmatch(traceparent.encode()):
        return None
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    _, trace_id, span_id, flags = traceparent.split("-")
    parent = SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16))
    )
    return set_span_in_context(NonRecordingSpan(parent))


def traceparent_of(span: Span) -> str:
    """`span` as the W3C traceparent that its children, in another process, continue."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def span_events(span: Span, stamps: list[tuple[str, int]]) -> None:
    """Triton's timestamps of a span, as its events."""
    for name, at_ns in stamps:
        span.add_event(name, timestamp=at_ns)
