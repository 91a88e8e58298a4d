"""The gateway's operations, whatever transport carries them: plain typed values in and out.

A transport (gateway/app.py for KServe v2 over HTTP) parses its requests into these calls and
encodes what they return; failures are the typed errors of shared/errors.py, which each
transport maps to its own status codes in one place. Nothing here knows of HTTP.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from sluice.gateway import metadata
from sluice.gateway.bulk_api import BulkApi, BulkUpload
from sluice.gateway.dispatcher import Dispatcher
from sluice.gateway.ensembles import Ensembles
from sluice.gateway.fleet_logging import FleetLogging
from sluice.gateway.infer_inputs import InferInput
from sluice.gateway.infer_results import (
    InferOutcome,
    StreamedResponse,
    outcome,
    streamed,
)
from sluice.gateway.model_table import ModelTable, ModelView, no_versions
from sluice.gateway.outbox import Route
from sluice.gateway.repository_api import RepositoryControl, refreshed
from sluice.gateway.response_cache.response_cache import ResponseCache
from sluice.gateway.restricted_apis import Restrictions
from sluice.gateway.system_shared_memory import SystemSharedMemory
from sluice.gateway.tracing import FleetTracing, Trace
from sluice.shared import keys
from sluice.shared.bulk import BulkStatus
from sluice.shared.errors import (
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    Unsupported,
)
from sluice.shared.fleet import fleet_status
from sluice.shared.infer_codec import ParsedInfer
from sluice.shared.log_control import process_control
from sluice.shared.partitions import share
from sluice.shared.protocol import Request, Result
from sluice.shared.queue_policy import DEADLINE, PRIORITY, TIMEOUT, deadline_us
from sluice.shared.repository_control import ControlMode
from sluice.shared.sequence_controls import SEQUENCE_PARAMETERS, check_sequence_request
from sluice.shared.signature import validate_inputs
from sluice.shared.trace_settings import TraceSettings

#: request parameters the workers act on.
FORWARDED_PARAMETERS = (PRIORITY, TIMEOUT, DEADLINE, *SEQUENCE_PARAMETERS)
#: a streamed request's parameter: send a decoupled model's flag-only final response too.
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
#: request parameters that only shape this gateway's answer, never a model's to see.
GATEWAY_PARAMETERS = frozenset({"binary_data_output", EMPTY_FINAL_RESPONSE})


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    """The gateway's limits, built from its settings (sluice/settings.py holds each default)."""

    max_body_bytes: int
    request_timeout_s: float
    #: when set, every request but the health probes needs `Authorization: Bearer <token>`.
    auth_token: str | None
    #: Triton's restricted APIs: category -> the header its requests must carry, on the HTTP
    #: port (--http-restricted-api) and the gRPC port (--grpc-restricted-protocol).
    http_restrictions: Restrictions
    grpc_restrictions: Restrictions
    #: when set, the metrics port needs `Authorization: Bearer <token>` (Triton's has no auth).
    metrics_auth_token: str | None
    #: how long a job and its result are kept.
    job_ttl_s: int
    #: jobs and bulk jobs kept fleet-wide at once (0: no limit).
    max_jobs: int
    max_bulk_jobs: int
    #: Triton's --model-control-mode; only "explicit" takes repository loads and unloads.
    model_control_mode: ControlMode
    #: models whose `file:` overrides the fleet keeps in Redis at once (0: no limit).
    max_override_models: int


@dataclass(slots=True)
class Prepared:
    """An infer request decoded and checked, ready to queue."""

    request: ParsedInfer
    version: int
    route: Route
    parameters: dict[str, Any]


class GatewayCore:
    """Metadata, readiness, statistics, infer and bulk uploads over the model table, the
    dispatcher and the bulk queue (`bulk`: a bulk job's status, cancel and output)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        table: ModelTable,
        limits: GatewayLimits,
        bulk: BulkApi,
        cache: ResponseCache | None = None,
        tracing: FleetTracing | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        #: Triton's trace extension (--trace-config); by default it traces nothing.
        self.tracing = tracing or FleetTracing(dispatcher.redis, TraceSettings(), None)
        #: Triton's response cache (--cache-config), for the models that enable it.
        self.cache = cache
        self.table = table
        self.limits = limits
        self.bulk = bulk
        self.ensembles = Ensembles(dispatcher, table)
        #: the regions of this gateway's clients' shared memory (Triton's extension).
        self.shared_memory = SystemSharedMemory()
        #: Triton's logging extension, fleet-wide.
        self.logging = FleetLogging(dispatcher.redis, process_control())
        #: Triton's repository index and model control, fleet-wide.
        self.repository = RepositoryControl(dispatcher.redis, table, limits)

    # -- server and models -------------------------------------------------------------------

    def server_metadata(self) -> dict[str, Any]:
        return metadata.server_metadata()

    def ready(self) -> bool:
        return self.table.ready

    async def fleet(self) -> dict[str, Any]:
        return await fleet_status(self.dispatcher.redis)

    def known_model(self, name: str) -> None:
        """Triton's answer to a trace setting for a model it does not know."""
        if name not in self.table.models and name not in self.table.repository:
            raise InvalidInput(f"Request for unknown model : {name}")

    async def statistics(self, model: str | None, version: str | None) -> dict[str, Any]:
        """Every model's statistics (`model` None), or one model's."""
        if self.cache is not None:
            await self.cache.stats.flush()  # this gateway's own cache hits show at once
        if model is None:
            views = list(self.table.models.values())
            return await metadata.model_statistics(self.dispatcher.redis, views, None)
        try:
            view = await self.view(model, version)
        except ModelNotFound:
            raise InvalidInput(f"requested model '{model}' is not available") from None
        wanted = int(version) if version else None
        if wanted is not None and wanted not in view.versions:
            message = f"requested model version is not available for model '{model}'"
            raise InvalidInput(message)
        return await metadata.model_statistics(self.dispatcher.redis, [view], wanted)

    async def view(self, name: str, version: str | None = None) -> ModelView:
        """The model `name` (ModelNotFound), looked for again in Redis if it is new here;
        `version`, when given, must be a version number (InvalidInput)."""
        if version is not None and not (
            version.isascii() and version.isdecimal() and len(version) <= 18
        ):
            raise InvalidInput(
                f"failed to get model version from specified version string '{version[:40]}' "
                "(details: stol), version should be an integral value > 0"
            )
        if name not in self.table.models:
            await refreshed(self.table)  # a model registered since the last refresh
        return self.table.get(name)

    async def model_ready(self, model: str, version: str | None) -> None:
        """Returns when the model (version) serves; ModelNotReady otherwise (an unknown model
        too, as Triton)."""
        try:
            view = await self.view(model, version)
        except ModelNotFound:
            raise ModelNotReady("Model version not ready") from None
        ready = (int(version) in view.ready_versions) if version else view.ready
        if not ready:
            raise ModelNotReady("Model version not ready")

    async def model_config(self, model: str, version: str | None) -> dict[str, Any]:
        view = await self.view(model, version)
        if version is not None:
            view.resolve_version(version)  # an unknown version is an unknown model
        if view.withdrawn:
            raise no_versions(model)
        if view.config is None:
            raise ModelNotReady(f"model '{model}' is not ready: {view.reason}")
        return view.config.json

    async def model_metadata(self, model: str, version: str | None) -> dict[str, Any]:
        view = await self.view(model, version)
        if version is not None:
            view.resolve_version(version)  # an unknown version is an unknown model
        if view.withdrawn:
            raise no_versions(model)
        if view.signature is None:
            raise ModelNotReady(f"model '{model}' is not ready: {view.reason}")
        return metadata.model_metadata(view, int(version) if version else None)

    async def submit_bulk(self, model: str, version: str | None, upload: BulkUpload) -> BulkStatus:
        """Start a bulk job on the model (a named version must be ready)."""
        view = await self.view(model, version)
        if view.withdrawn:
            raise no_versions(model)
        resolved = view.resolve_version(version) if version else None
        return await self.bulk.submit(view.name, resolved, upload)

    # -- infer -------------------------------------------------------------------------------

    async def infer(
        self,
        model: str,
        version: str | None,
        infer: InferInput,
        client_gone: asyncio.Future[None] | None = None,
        endpoint: str = "HTTP end point",
        traceparent: str | None = None,
    ) -> InferOutcome:
        """Queue the request and wait for its result; `client_gone` resolving cancels it.
        A decoupled model is refused, as Triton refuses it on `endpoint`: its responses
        need a stream (`stream`). `traceparent` is the client's trace context; a traced
        request's outcome carries its trace, for the transport to end (`responded`)."""
        view = await self.view(model, version)
        if view.config is not None and view.config.decoupled:
            raise Unsupported(
                f"{endpoint} doesn't support models with decoupled transaction policy"
            )
        tracing = self.tracing
        trace = tracing.begin(view.name, time.time_ns(), traceparent)
        if trace is None:
            prepared = self.prepare(view, version, infer)
            result = await self._result(view, prepared, client_gone)
            return outcome(view.name, prepared.version, prepared.request, result)
        answered, error = None, None
        try:
            prepared = self.prepare(view, version, infer, trace)
            trace.version, trace.request_id = prepared.version, prepared.request.id or ""
            trace.inputs = prepared.request.inputs
            answered = await self._result(view, prepared, client_gone, trace)
            served = outcome(view.name, prepared.version, prepared.request, answered)
            served.trace = trace
            return served
        except BaseException as exc:
            error = str(exc) or type(exc).__name__
            raise
        finally:
            tracing.end(trace, answered, time.time_ns(), error)

    async def _result(
        self,
        view: ModelView,
        prepared: Prepared,
        client_gone: asyncio.Future[None] | None,
        trace: Trace | None = None,
    ) -> Result:
        """The request's one result: from the response cache, or run (and then cached)."""
        lookup = None
        if self.cache is not None and self.cache.serves(view):
            lookup = await self.cache.lookup(view.name, prepared.version, prepared.request)
            if lookup.hit is not None:
                outputs, parameters = lookup.hit
                return Result("", outputs, parameters=parameters)
        result = await self._run(view, prepared, client_gone, trace)
        if lookup is not None:
            assert self.cache is not None
            await self.cache.insert(lookup, result)
        return result

    async def _run(
        self,
        view: ModelView,
        prepared: Prepared,
        client_gone: asyncio.Future[None] | None,
        trace: Trace | None = None,
    ) -> Result:
        params = prepared.parameters
        timeout_s, timeout_message = _time_limit(params, self.limits.request_timeout_s)
        if view.is_ensemble:
            return await self.ensembles.infer(
                *(view, prepared.version, prepared.request, params),
                *(timeout_s, timeout_message, client_gone, trace),
            )
        request = _new_request(self.dispatcher, prepared)
        if trace is not None:
            _trace_request(trace, request)

        def cancel(_: object) -> None:
            self.dispatcher.cancel(view.name, request.id)

        if client_gone is not None:
            client_gone.add_done_callback(cancel)
        try:
            return await self.dispatcher.submit(
                prepared.route, request, timeout_s, view.preserve_ordering, timeout_message
            )
        finally:
            if client_gone is not None:
                client_gone.remove_done_callback(cancel)

    async def stream(
        self,
        model: str,
        version: str | None,
        infer: InferInput,
        client_gone: asyncio.Future[None] | None = None,
        traceparent: str | None = None,
    ) -> AsyncGenerator[StreamedResponse, None]:
        """Check the request (what fails here raises at once), then its responses in order:
        a decoupled model's zero or more, any other model's one. The request is queued as
        the iteration starts, so requests whose iterations start in order are queued in
        order (a gRPC stream's, some of one sequence). `client_gone` resolving, or the
        caller leaving the iteration early, cancels the request. A traced request's trace
        (`traceparent`: the client's context) ends with its last response."""
        view = await self.view(model, version)
        trace = self.tracing.begin(view.name, time.time_ns(), traceparent)
        try:
            prepared = self.prepare(view, version, infer, trace)
        except BaseException as exc:
            if trace is not None:
                self.tracing.end(trace, None, time.time_ns(), str(exc) or type(exc).__name__)
            raise
        if view.is_ensemble or (self.cache is not None and self.cache.serves(view)):
            answers = self._one_response(view, prepared, client_gone, trace)
        else:
            limit_s, timeout_message = _time_limit(
                prepared.parameters, self.limits.request_timeout_s
            )
            request = _new_request(self.dispatcher, prepared)
            if trace is not None:
                _trace_request(trace, request)
            results = self.dispatcher.stream(prepared.route, request, limit_s, timeout_message)
            answers = self._responses(view.name, prepared, request, results, client_gone)
        if trace is None:
            return answers
        trace.version, trace.request_id = prepared.version, prepared.request.id or ""
        trace.inputs = prepared.request.inputs
        return self._traced(answers, trace)

    async def _traced(
        self, answers: AsyncGenerator[StreamedResponse, None], trace: Trace
    ) -> AsyncGenerator[StreamedResponse, None]:
        """A streamed request's responses; its trace ends with the last of them (a caller
        that leaves early ends it as failed)."""
        error: str | None = None
        try:
            async for answer in answers:
                if answer.error is not None:
                    error = str(answer.error)
                yield answer
        except BaseException as exc:
            error = str(exc) or "the stream ended early"
            raise
        finally:
            await answers.aclose()
            now_ns = time.time_ns()
            self.tracing.end(trace, None, now_ns, error)
            if error is None:
                self.tracing.responded(trace, now_ns)

    async def _one_response(
        self,
        view: ModelView,
        prepared: Prepared,
        client_gone: asyncio.Future[None] | None,
        trace: Trace | None = None,
    ) -> AsyncGenerator[StreamedResponse, None]:
        """An ensemble's or a cached model's response (neither is decoupled)."""
        result = await self._result(view, prepared, client_gone, trace)
        yield streamed(view.name, prepared.version, prepared.request, result)

    async def _responses(
        self,
        model: str,
        prepared: Prepared,
        request: Request,
        results: AsyncGenerator[Result, None],
        client_gone: asyncio.Future[None] | None,
    ) -> AsyncGenerator[StreamedResponse, None]:
        def cancel(_: object) -> None:
            self.dispatcher.cancel(model, request.id)

        if client_gone is not None:
            client_gone.add_done_callback(cancel)
        try:
            async for result in results:
                yield streamed(model, prepared.version, prepared.request, result)
        finally:
            if client_gone is not None:
                client_gone.remove_done_callback(cancel)
            await results.aclose()

    def prepare(
        self,
        view: ModelView,
        version_text: str | None,
        infer: InferInput,
        trace: Trace | None = None,
    ) -> Prepared:
        """Decode and check an infer request; what fails here is counted as a failure.
        A traced request's spans mark where the decode and the checks end."""
        version = view.resolve_version(version_text) or max(view.versions)
        sig = view.signature
        assert sig is not None
        body = infer.inflate(self.limits.max_body_bytes)
        try:
            parsed = infer.decode(body, sig)
            spans = trace.spans if trace is not None else None
            if spans is not None:
                spans.decoded_ns = time.time_ns()
            validate_inputs(sig, parsed.inputs, parsed.id or "")
            known = sig.output_names()
            for output in parsed.outputs or ():
                if output not in known:
                    raise InvalidInput(
                        f"unexpected inference output '{output}' for model '{view.name}'"
                    )
            if view.config is not None and view.config.sequence_batched:
                batch_size = parsed.inputs[0].shape[0] if sig.max_batch_size > 0 else 1
                check_sequence_request(view.name, parsed.parameters, batch_size)
            params = _forwarded(view, parsed.parameters)
            policy = view.queue_policy
            level = policy.level_of(params)
            deadline_us(params)
        except InvalidInput:
            self._count_failure(view.name, version, "OTHER")
            raise
        if spans is not None:
            spans.checked_ns = time.time_ns()
        limit = share(policy.for_level(level).max_queue_size, view.partitions)
        config = view.config
        sequenced = config is not None and config.sequence_batched
        checkpointed = config is not None and config.sequence_checkpoint
        route = Route(
            *(view.name, level, max(1, sig.max_batch_size), limit, view.partitions),
            *(sequenced, checkpointed),
        )
        return Prepared(parsed, version, route, params)

    def _count_failure(self, model: str, version: int, reason: str) -> None:
        """Failures that never reach a worker still show in the fleet-wide metrics."""
        coro = self.dispatcher.redis.hincrby(keys.GATEWAY_STATS, f"{model}:{version}:{reason}", 1)
        task = asyncio.ensure_future(coro)
        task.add_done_callback(lambda t: t.exception())


def _time_limit(params: dict[str, Any], request_timeout_s: float) -> tuple[float, str]:
    """How long the request may take (its deadline, when it gives one and it is sooner than
    the gateway's timeout) and the error it then ends with, as Triton words each."""
    deadline_s = deadline_us(params) / 1e6
    timeout_s = min(request_timeout_s, deadline_s or request_timeout_s)
    return timeout_s, "Request deadline exceeded" if deadline_s else "Request timeout expired"


def _trace_request(trace: Trace, request: Request) -> None:
    """The request carries its trace to its worker (in OpenTelemetry mode, its context)."""
    request.traced = True
    if trace.spans is not None:
        request.traceparent = trace.spans.traceparent
    trace.stamps.append(("QUEUE_START", request.enqueue_ns))


def _new_request(dispatcher: Dispatcher, prepared: Prepared) -> Request:
    parsed = prepared.request
    return Request(
        dispatcher.new_request_id(),
        prepared.version,
        time.time_ns(),
        dispatcher.reply_stream,
        parsed.inputs,
        tuple(parsed.outputs) if parsed.outputs else None,
        prepared.parameters,
    )


def _forwarded(view: ModelView, parameters: dict[str, Any]) -> dict[str, Any]:
    """What a worker gets of the request's parameters: those it acts on, and for a Python
    model or an ensemble (whose steps inherit them, as in Triton) all of them (a Triton Python
    model reads them: `request.parameters()`)."""
    if not parameters:
        return parameters
    python = view.config is not None and view.config.backend == "python"
    if python or view.is_ensemble:
        return {k: v for k, v in parameters.items() if k not in GATEWAY_PARAMETERS}
    return {k: v for k, v in parameters.items() if k in FORWARDED_PARAMETERS}
