"""An OTLP/HTTP trace receiver on loopback: what the OpenTelemetry collector's `otlp` receiver
takes on /v1/traces (protobuf, or OTLP/JSON as tritonserver's exporter sends it; optionally
gzip), decoded into plain spans a test can read.

Run alone (`python tests/otlp_receiver.py PORT`) it prints each span as a JSON line, for a
side-by-side look at what tritonserver exports.
"""

from __future__ import annotations

import gzip
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_BODY = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def decode_json(body: bytes) -> list[Span]:
    """OTLP/JSON: ids in hex, numbers of nanoseconds as strings, values keyed by their type."""

    def value(v: dict[str, Any]) -> Any:
        [(kind, raw)] = v.items()
        if kind == "arrayValue":
            return [value(x) for x in raw.get("values", [])]
        return int(raw) if kind == "intValue" else raw

    def attributes(pairs: list[dict[str, Any]]) -> dict[str, Any]:
        return {pair["key"]: value(pair["value"]) for pair in pairs}

    spans = []
    for resource_spans in orjson.loads(body)["resourceSpans"]:
        resource = attributes(resource_spans["resource"].get("attributes", []))
        for scope in resource_spans["scopeSpans"]:
            for s in scope["spans"]:
                spans.append(
                    Span(
                        s["traceId"],
                        s["spanId"],
                        s.get("parentSpanId", ""),
                        s["name"],
                        int(s["startTimeUnixNano"]),
                        int(s["endTimeUnixNano"]),
                        attributes(s.get("attributes", [])),
                        resource,
                        [(link["traceId"], link["spanId"]) for link in s.get("links", [])],
                        [event["name"] for event in s.get("events", [])],
                    )
                )
    return spans


def decode(body: bytes) -> list[Span]:
    message = ExportTraceServiceRequest()
    message.ParseFromString(body)
    spans = []
    for resource_spans in message.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope in resource_spans.scope_spans:
            for s in scope.spans:
                spans.append(
                    Span(
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.name,
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        _attributes(s.attributes),
                        resource,
                        [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        [event.name for event in s.events],
                    )
                )
    return spans


class OtlpReceiver:
    """Collects the spans exported to http://127.0.0.1:<port>/v1/traces."""

    def __init__(self, port: int = 0, echo: bool = False) -> None:
        self.spans: list[Span] = []
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                if self.path != "/v1/traces" or not 0 < length <= MAX_BODY:
                    self.send_error(404 if self.path != "/v1/traces" else 400)
                    return
                body = self.rfile.read(length)
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                json = self.headers.get("content-type", "").startswith("application/json")
                spans = decode_json(body) if json else decode(body)
                if echo:
                    for span in spans:
                        print(orjson.dumps(span).decode(), flush=True)
                with receiver.changed:
                    receiver.spans += spans
                    receiver.changed.notify_all()
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def wait_for(self, condition: Any, timeout_s: float = 60.0) -> list[Span]:
        """The spans received once `condition(spans)` holds (TimeoutError if it never does)."""
        with self.changed:
            if not self.changed.wait_for(lambda: condition(self.spans), timeout_s):
                raise TimeoutError(f"spans received: {[s.name for s in self.spans]}")
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    receiver = OtlpReceiver(int(sys.argv[1]), echo=True)
    threading.Event().wait()
