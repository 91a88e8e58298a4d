"""Triton's trace extension at the gateway (`mode=triton`, level TIMESTAMPS): which requests
are traced, the fleet's trace settings, and the trace written for each.

The settings are the command line's (`--trace-config`) under the fleet's, which
`/v2/trace/setting` and gRPC `TraceSetting` change for every gateway (one Redis hash,
`keys.TRACE_SETTINGS`: field `global`, and `model:<name>` for a model's own values); each
gateway reads it every FOLLOW_INTERVAL_S and at once after its own change. Every `rate`-th
request of a model is traced while `count` (per gateway) lasts. A traced request carries a
flag to its worker, which sends its batch's compute timestamps back with the result; the
gateway adds its own (REQUEST_START, QUEUE_START, REQUEST_END) and writes the trace, or in
OpenTelemetry mode exports its spans (gateway/trace_spans.py), the request carrying its
model span's traceparent for the worker's. There a client's valid `traceparent` is traced
whatever the rate and count, as Triton does (`rate=0`: only those).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from sluice.gateway.trace_file import TraceFile, tensor_objects, trace_objects
from sluice.gateway.trace_spans import GatewaySpans, RequestSpans
from sluice.shared import keys
from sluice.shared.log_control import FOLLOW_INTERVAL_S
from sluice.shared.otel import context_of
from sluice.shared.protocol import Result, Tensor
from sluice.shared.redis_client import REDIS_ERRORS
from sluice.shared.trace_settings import TraceSettings, parse_update

log = logging.getLogger(__name__)

GLOBAL = "global"
COMPUTE = ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END")


def _field(model: str | None) -> str:
    return GLOBAL if model is None else f"model:{model}"


@dataclass(slots=True)
class Trace:
    """One traced request's timestamps so far (wall-clock ns)."""

    id: int
    model: str
    version: int = 0
    request_id: str = ""
    stamps: list[tuple[str, int]] = field(default_factory=list)
    #: OpenTelemetry mode: its spans, open until the request is answered.
    spans: RequestSpans | None = None
    #: an ensemble's: the compute timestamps its answer brings are its last step's, which
    #: Triton's file keeps to that step's own trace.
    ensemble: bool = False
    #: the request's inputs, for level TENSORS.
    inputs: Sequence[Tensor] = ()


class FleetTracing:
    def __init__(
        self,
        redis: Any,
        baseline: TraceSettings,
        file: TraceFile | None,
        spans: GatewaySpans | None = None,
    ) -> None:
        self.redis = redis
        self.baseline = baseline
        self.file = file
        #: OpenTelemetry mode's exporter (then `file` is None).
        self.spans = spans
        #: whether a request's own trace context is read (OpenTelemetry mode).
        self.follows_context = spans is not None
        #: the fleet's values: field name -> its values (`global`, `model:<name>`).
        self._fleet: dict[str, dict[str, Any]] = {}
        #: requests of each model since its last trace, and traces taken per setting's scope
        #: since its count was last set.
        self._seen: Counter[str] = Counter()
        self._taken: Counter[str] = Counter()
        self._ids = itertools.count(1)
        #: each model's settings as last worked out: a request's look-up is one dict get,
        #: until the fleet's settings change or a trace is taken.
        self._known: dict[str | None, TraceSettings] = {}

    def settings(self, model: str | None = None) -> TraceSettings:
        """The settings `model` is traced by (None: the global ones), its count what is left."""
        known = self._known.get(model)
        if known is None:
            known = self._known[model] = self._worked_out(model)
        return known

    def _worked_out(self, model: str | None) -> TraceSettings:
        values = {**self._fleet.get(GLOBAL, {})}
        if model is not None:
            values.update(self._fleet.get(_field(model), {}))
        settings = self.baseline.with_values(values)
        if settings.count > 0:
            left = max(0, settings.count - self._taken[self._scope(model)])
            settings = settings.with_values({"count": left})
        return settings

    def _scope(self, model: str | None) -> str:
        own = model is not None and "count" in self._fleet.get(_field(model), {})
        return _field(model) if own else GLOBAL

    def begin(self, model: str, at_ns: int, traceparent: str | None = None) -> Trace | None:
        """A trace of this request of `model`, if it is to be traced; `traceparent` is the
        client's trace context (OpenTelemetry mode)."""
        if self.file is None and self.spans is None:
            return None
        settings = self.settings(model)
        parent = context_of(traceparent) if self.spans is not None else None
        if parent is not None:
            if not settings.level:
                return None
        elif not self._sampled(model, settings):
            return None
        trace = Trace(next(self._ids), model, stamps=[("REQUEST_START", at_ns)])
        if self.spans is not None:
            trace.spans = self.spans.open(model, at_ns, parent)
        return trace

    def _sampled(self, model: str, settings: TraceSettings) -> bool:
        """Every rate-th request of `model`, while the count lasts."""
        if not settings.on:
            return False
        self._seen[model] += 1
        if self._seen[model] < settings.rate:
            return False
        self._seen[model] = 0
        if settings.count > 0:
            self._taken[self._scope(model)] += 1
            self._known.clear()
        return True

    def end(
        self, trace: Trace, result: Result | None, at_ns: int, error: str | None = None
    ) -> None:
        """The request was answered (`error`: it failed): its trace goes to the file, or its
        model's span ends (the root's once the response is made: `responded`)."""
        timestamps = result.timestamps if result is not None else None
        if timestamps is not None and not trace.ensemble:
            trace.stamps += zip(COMPUTE, timestamps, strict=True)
        trace.stamps.append(("REQUEST_END", at_ns))
        if trace.spans is not None:
            assert self.spans is not None
            attributes: dict[str, str | int] = {
                "triton.model_name": trace.model,
                "triton.model_version": trace.version,
                "triton.trace_id": trace.id,
                "triton.trace_parent_id": 0,
            }
            if trace.request_id:
                attributes["triton.request_id"] = trace.request_id
            compute_end = timestamps[-1] if timestamps else None
            self.spans.close(trace.spans, attributes, trace.stamps, compute_end, error)
            if error is not None:
                self.spans.respond(trace.spans, at_ns, at_ns, error)
            return
        assert self.file is not None
        tensors: list[dict[str, Any]] = []
        size = 0
        if "TENSORS" in self.settings(trace.model).level:
            outputs = result.outputs if result is not None and result.error is None else ()
            tensors, size = tensor_objects(trace.id, "TENSOR_QUEUE_INPUT", trace.inputs)
            produced, more = tensor_objects(trace.id, "TENSOR_BACKEND_OUTPUT", outputs)
            tensors, size = tensors + produced, size + more
        objects = trace_objects(
            trace.id, trace.model, trace.version, trace.request_id, trace.stamps, tensors
        )
        self.file.add(objects, self.settings().log_frequency, size)

    def responded(self, trace: Trace | None, at_ns: int) -> None:
        """The response to a traced request is made: its root span ends (OpenTelemetry)."""
        if trace is not None and trace.spans is not None:
            assert self.spans is not None
            self.spans.respond(trace.spans, trace.stamps[-1][1], at_ns, None)

    # -- the fleet's settings ----------------------------------------------------------------

    async def refresh(self) -> None:
        fields = await self.redis.hgetall(keys.TRACE_SETTINGS)
        fleet: dict[str, dict[str, Any]] = {}
        for name, raw in fields.items():
            try:
                values = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if isinstance(values, dict):
                fleet[name.decode() if isinstance(name, bytes) else name] = values
        for scope in set(self._fleet) | set(fleet):
            if self._fleet.get(scope, {}).get("count_set") != fleet.get(scope, {}).get("count_set"):
                self._taken.pop(scope, None)  # a count set anew counts from its start
        if fleet != self._fleet:
            self._fleet = fleet
            self._known.clear()

    async def follow(self) -> None:
        """Read the fleet's settings every FOLLOW_INTERVAL_S until cancelled."""
        while True:
            try:
                await self.refresh()
            except REDIS_ERRORS as exc:
                log.debug("trace settings not read: %s", exc)
            await asyncio.sleep(FOLLOW_INTERVAL_S)

    async def update(self, model: str | None, body: Mapping[str, Any]) -> TraceSettings:
        """Change the global settings (or `model`'s own) fleet-wide: all of `body` or, when
        Triton would refuse it, none (TraceSettingsError)."""
        await self.refresh()
        values = parse_update(body)
        scope = _field(model)
        own = {**self._fleet.get(scope, {})}
        for name, value in values.items():
            if value is None:
                own.pop(name, None)
            elif name == "level":
                own[name] = sorted(value)
            else:
                own[name] = value
        if "count" in values:  # a count set again counts from its start, even the same count
            own["count_set"] = time.time_ns()
        scoped = own if model is None else {**self._fleet.get(GLOBAL, {}), **own}
        self.baseline.with_values(scoped).checked()
        await self.redis.hset(keys.TRACE_SETTINGS, scope, orjson.dumps(own))
        await self.refresh()
        return self.settings(model)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.spans is not None:
            self.spans.close_exporter()
