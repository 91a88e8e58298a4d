"""Ensemble requests at the gateway: send the source steps, wait for the one answer.

The gateway never runs a step and never sees an intermediate tensor: it sends one ordinary
request per source step (a step fed by the client's inputs alone) to that model's stream, with
the continuation the workers follow (sluice.shared.ensemble_wire), and waits on its reply
stream for the ensemble request's id, which the last step (or the first failing one) answers.
Client inputs that later steps need travel with the step requests.
The ensemble's own statistics (counts, request time; queue time 0, as Triton reports) are
logged here, since only the gateway sees the whole request.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sluice.gateway.dispatcher import Dispatcher
from sluice.gateway.model_table import ModelTable, ModelView
from sluice.gateway.outage import RETRY_AFTER_S
from sluice.gateway.outbox import Route
from sluice.gateway.tracing import Trace
from sluice.shared import keys
from sluice.shared.ensemble import CLIENT, EnsembleError, Plan, build_plan, collect_configs
from sluice.shared.ensemble_wire import Continuation, step_request
from sluice.shared.errors import ModelNotReady, SluiceError
from sluice.shared.infer_codec import ParsedInfer
from sluice.shared.protocol import Request, Result, encode_requests
from sluice.shared.redis_client import REDIS_ERRORS, redis_failure
from sluice.shared.redis_wire import xadd
from sluice.shared.signature import validate_inputs
from sluice.shared.stats import BatchStats, stats_record

#: the join state outlives the request's timeout by this much, so a late step finds it.
STATE_GRACE_MS = 5_000


class Ensembles:
    """Runs ensemble requests over the dispatcher and the model table."""

    def __init__(self, dispatcher: Dispatcher, table: ModelTable) -> None:
        self.dispatcher = dispatcher
        self.table = table
        #: each ensemble's plan, with the configs it was built from.
        self._plans: dict[str, tuple[dict[str, Any], Plan]] = {}

    def plan(self, view: ModelView) -> Plan:
        """The ensemble's flat plan from the fleet's configs; its composing models must serve.
        Built again only when one of those configs changed (the table replaces a config's
        view, and its JSON, when a worker publishes a new one)."""
        configs = collect_configs(view.name, self._config)
        cached = self._plans.get(view.name)
        if cached is not None and _same(cached[0], configs):
            plan = cached[1]
        else:
            try:
                plan = build_plan(view.name, configs)
            except EnsembleError as exc:
                message = f"ensemble '{view.name}' is not ready: {exc.message}"
                raise ModelNotReady(message) from None
            self._plans[view.name] = (configs, plan)
        for step in plan.steps:
            composing = self.table.models.get(step.model)
            if composing is None or not composing.ready:
                raise ModelNotReady(f"in ensemble '{view.name}', model '{step.model}' is not ready")
        return plan

    def _config(self, name: str) -> dict[str, Any] | None:
        """A model's config as JSON, which the plan is built from."""
        view = self.table.models.get(name)
        return view.config.json if view is not None and view.config is not None else None

    async def infer(
        self,
        view: ModelView,
        version: int,
        parsed: ParsedInfer,
        parameters: dict[str, Any],
        timeout_s: float,
        timeout_message: str,
        client_gone: asyncio.Future[None] | None,
        trace: Trace | None = None,
    ) -> Result:
        """Run the ensemble request and return its answer (or the first step's error). A
        traced one's steps carry its trace, each step's worker opening a span for its model
        under the ensemble's (OpenTelemetry mode)."""
        plan = self.plan(view)
        started_ns = time.time_ns()
        request_id = self.dispatcher.new_request_id()
        levels = tuple(
            self.table.get(s.model).queue_policy.level_of(parameters) for s in plan.steps
        )
        requested = tuple(parsed.outputs) if parsed.outputs else None
        ttl_ms = int(timeout_s * 1000) + STATE_GRACE_MS
        reply_to = self.dispatcher.reply_stream
        cont = Continuation(plan, CLIENT, reply_to, requested, levels, ttl_ms)
        parent = Request(request_id, 0, started_ns, reply_to, [], None, parameters)
        if trace is not None:
            trace.ensemble = True
            parent.traced, parent.model_span = True, True
            if trace.spans is not None:
                parent.traceparent = trace.spans.traceparent
            trace.stamps.append(("QUEUE_START", started_ns))
        tensors = {t.name: t for t in parsed.inputs}
        first, *others = plan.sources()
        sends: list[Any] = []
        for step in others:
            stream, request = step_request(parent, cont, step, tensors, started_ns)
            sends.append(xadd(stream, encode_requests([request])))
        if sends:
            pipe = self.dispatcher.redis.pipeline(transaction=False)
            for command in sends:
                pipe.execute_command(*command)
            try:
                await pipe.execute()
            except REDIS_ERRORS as exc:  # out of memory: Redis refuses every one of them
                unreachable = "queue unavailable"
                raise redis_failure(exc, "request not queued", unreachable, RETRY_AFTER_S) from None
        _, request = step_request(parent, cont, first, tensors, started_ns)
        composing = self.table.get(plan.steps[first].model)
        assert composing.signature is not None
        # steps are outside max_queue_size: the workers that send the next steps cannot
        # count them in, so neither does the gateway
        route = Route(composing.name, levels[first], max(1, composing.signature.max_batch_size))

        def cancel(_: object) -> None:
            for model in dict.fromkeys(s.model for s in plan.steps):
                self.dispatcher.cancel(model, request_id)

        if client_gone is not None:
            client_gone.add_done_callback(cancel)
        try:
            result = await self.dispatcher.submit(route, request, timeout_s, False, timeout_message)
        except SluiceError:
            self._record(view, version, parsed, started_ns, ok=False)
            raise
        finally:
            if client_gone is not None:
                client_gone.remove_done_callback(cancel)
        self._record(view, version, parsed, started_ns, ok=result.error is None)
        return result

    def _record(
        self, view: ModelView, version: int, parsed: ParsedInfer, started_ns: int, ok: bool
    ) -> None:
        """The ensemble's statistics: one request, its time counted as compute (Triton sums
        its steps' compute into the ensemble's and reports a queue time of about 0)."""
        sig = view.signature
        elapsed_ns = max(0, time.time_ns() - started_ns)
        batch = validate_inputs(sig, parsed.inputs) if sig is not None else 1
        stats = BatchStats(version, batch, started_ns // 1_000_000)
        stats.requests_ok, stats.requests_failed = (1, 0) if ok else (0, 1)
        stats.failure_reason = "OTHER"
        stats.queue_samples_ns = [0]
        stats.request_samples_ns = [elapsed_ns]
        stats.infer_ns = elapsed_ns
        record = stats_record(stats.increments())
        log_key = keys.model_stats_log(view.name)
        task = asyncio.ensure_future(self.dispatcher.redis.rpush(log_key, record))
        task.add_done_callback(lambda t: t.exception())


def _same(built_from: dict[str, Any], configs: dict[str, Any]) -> bool:
    return built_from.keys() == configs.keys() and all(
        configs[name] is config for name, config in built_from.items()
    )
