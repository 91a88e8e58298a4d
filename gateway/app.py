"""The KServe v2 HTTP transport over the gateway core: parse, route, call, encode.

No framework: a route table (gateway/routing.py) picks the endpoint, each endpoint turns the
request into a call of the core (gateway/core.py, gateway/job_operations.py) and its answer
into a response, and every error becomes its status and body in `http_error`, the one place
that knows the mapping.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qsl

import orjson
from sluice.gateway.bearer import REFUSAL as BEARER_REFUSAL
from sluice.gateway.bearer import bearer_matches
from sluice.gateway.bulk_api import BulkUpload
from sluice.gateway.core import GatewayCore, GatewayLimits
from sluice.gateway.generate import Answers, GenerateInfer, generate, generate_stream
from sluice.gateway.infer_inputs import RestInfer
from sluice.gateway.infer_results import InferOutcome
from sluice.gateway.job_operations import JobEvent, JobOperations, JobResponses, JobState
from sluice.gateway.outage import RETRY_AFTER_S
from sluice.gateway.restricted_apis import http_category, http_refusal
from sluice.gateway.routing import Route, Router
from sluice.gateway.system_shared_memory import RegionNotFound
from sluice.shared.bulk import BulkStatus
from sluice.shared.errors import (
    InvalidInput,
    MethodNotAllowed,
    PayloadTooLarge,
    SluiceError,
    Unauthorized,
    UnknownRoute,
)
from sluice.shared.http_messages import (
    JSON,
    HttpRequest,
    HttpResponse,
    error_response,
    json_response,
)
from sluice.shared.infer_codec import HEADER_LENGTH, encode_response
from sluice.shared.redis_client import REDIS_ERRORS, UNWRITTEN, redis_failure
from sluice.shared.trace_settings import TraceSettingsError

log = logging.getLogger(__name__)

HEADER_LENGTH_KEY = HEADER_LENGTH.encode()
BINARY = (b"content-type", b"application/octet-stream")
NPZ, NDJSON = b"application/x-npz", b"application/x-ndjson"
GET, POST, DELETE = frozenset({"GET"}), frozenset({"POST"}), frozenset({"DELETE"})
#: Triton's answer to a path it does not serve
NOT_FOUND = "Not Found"
_VERSION = re.compile("[0-9]+")
Params = dict[str, str]


def http_error(exc: Exception, request: HttpRequest) -> HttpResponse:
    """Any failure of a request as its answer: a typed error's status and body, Redis away as
    a 503 with Retry-After, anything else a 500 (a bug must still answer)."""
    if isinstance(exc, SluiceError):
        return error_response(exc)
    if isinstance(exc, REDIS_ERRORS):  # a read of the fleet's records (fleet, stats) meanwhile
        return error_response(redis_failure(exc, UNWRITTEN, "Redis is unreachable", RETRY_AFTER_S))
    log.exception("unhandled error on %s %s", request.method, request.path)
    return error_response(SluiceError(f"internal error: {exc!r}"))


def infer_response(outcome: InferOutcome) -> HttpResponse:
    """The infer response, binary or JSON as the request asked."""
    body_parts, json_length = encode_response(
        outcome.model, outcome.version, outcome.request, outcome.outputs, outcome.parameters
    )
    if json_length is None:
        return HttpResponse(200, body_parts, JSON)
    return HttpResponse(200, body_parts, [BINARY, (HEADER_LENGTH_KEY, b"%d" % json_length)])


def _content_encoding(request: HttpRequest) -> str | None:
    """The Content-Encoding as text: any bytes decode as latin-1, so one that is not UTF-8 is
    an unsupported encoding (400), not a decoding error."""
    encoding = request.headers.get(b"content-encoding")
    return encoding.decode("latin-1") if encoding else None


def _rest_infer(request: HttpRequest) -> RestInfer:
    return RestInfer(
        request.body, _content_encoding(request), request.headers.get(HEADER_LENGTH_KEY)
    )


def _generate_infer(request: HttpRequest) -> GenerateInfer:
    return GenerateInfer(request.body, _content_encoding(request))


def _job_state(state: JobState) -> HttpResponse:
    body: dict[str, Any] = {"id": state.id, "status": state.status}
    if state.model is not None:
        body.update(model_name=state.model, model_version=str(state.version))
    headers = [*JSON, (b"location", f"/v2/jobs/{state.id}".encode())]
    return HttpResponse(202, orjson.dumps(body), headers)


def _bulk_status(status: BulkStatus, code: int = 200) -> HttpResponse:
    headers = [*JSON, (b"location", f"/v2/bulk/{status.id}".encode())]
    return HttpResponse(code, orjson.dumps(status.to_json()), headers)


def _wait_s(query: str) -> float:
    for key, value in parse_qsl(query):
        if key == "wait":
            try:
                wait_s = float(value)
            except ValueError:
                raise InvalidInput("'wait' must be a number of seconds") from None
            if not wait_s >= 0:
                raise InvalidInput("'wait' must not be negative")
            return wait_s
    return 0.0


class _UnparsedSettings(Exception):
    """A settings body that is not JSON: Triton answers 500 with the parser's words."""

    def response(self) -> HttpResponse:
        return json_response({"error": f"failed to parse the request JSON buffer: {self}"}, 500)


def _settings_changes(request: HttpRequest) -> dict[str, Any]:
    """A /v2/logging or trace setting update's keys (a body that is not an object: none)."""
    try:
        changes = orjson.loads(request.body)
    except orjson.JSONDecodeError as exc:
        raise _UnparsedSettings(str(exc)) from None
    return changes if isinstance(changes, dict) else {}


def _json_body(request: HttpRequest) -> dict[str, Any]:
    """An optional JSON object body (empty: {})."""
    if not request.body.strip():
        return {}
    try:
        body = orjson.loads(request.body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"failed to parse the request JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInput("the request body must be a JSON object")
    return body


def _parameters(request: HttpRequest) -> dict[str, Any]:
    parameters = _json_body(request).get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    return parameters


def _load_parameters(parameters: dict[str, Any]) -> tuple[str | None, dict[str, bytes]]:
    """A load's `config` (a string of model-config JSON) and `file:<path>` contents (base64)."""
    config = parameters.get("config")
    if config is not None and not isinstance(config, str):
        raise InvalidInput("parameter 'config' must be a string holding the model config JSON")
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        if not key.startswith("file:"):
            continue
        if not isinstance(value, str):
            raise InvalidInput(f"parameter '{key}' must be a base64 string")
        try:
            files[key] = base64.b64decode(value, validate=True)
        except binascii.Error as exc:
            raise InvalidInput(f"parameter '{key}' is not valid base64: {exc}") from None
    return config, files


async def _sse(events: AsyncIterator[JobEvent]) -> AsyncIterator[bytes]:
    """Server-sent events; a comment while waiting keeps proxies from closing the stream."""
    async for event in events:
        if event is None:
            yield b": waiting\n\n"
        else:
            name, data = event
            yield b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


#: Triton's status for each kind of refused logging update.
LOG_REFUSAL_STATUS = {"file": 501, "format": 503, "type": 500}


class GatewayApp:
    """The HTTP handler (`HttpServer(app)`): `app(HttpRequest) -> HttpResponse`."""

    def __init__(self, core: GatewayCore, jobs: JobOperations, limits: GatewayLimits) -> None:
        self.core = core
        self.jobs = jobs
        self.auth_token = None if limits.auth_token is None else limits.auth_token.encode()
        self.restrictions = limits.http_restrictions
        self.router = Router(self._routes(), not_allowed=self._not_allowed)

    def _routes(self) -> list[Route]:
        model, version = "v2/models/{model}", "v2/models/{model}/versions/{version}"
        return [
            Route(f"{model}/infer/**", self._infer, POST),
            Route(f"{version}/infer/**", self._infer, POST),
            Route("v2", self._server_metadata, GET),
            Route("v2/health/live", self._live, GET),
            Route("v2/health/ready", self._ready, GET),
            Route("v2/fleet", self._fleet, GET),
            Route("v2/repository/index", self._repository_index, POST),
            Route("v2/repository/models/{model}/load", self._load_model, POST),
            Route("v2/repository/models/{model}/unload", self._unload_model, POST),
            Route("v2/jobs/{job}", self._get_job, GET),
            Route("v2/jobs/{job}", self._cancel_job, DELETE),
            Route("v2/jobs/{job}/events", self._job_events, GET),
            Route("v2/bulk/{bulk}", self._bulk_status, GET),
            Route("v2/bulk/{bulk}", self._cancel_bulk, DELETE),
            Route("v2/bulk/{bulk}/output", self._bulk_output, GET),
            Route("v2/models/stats", self._all_statistics, GET),
            Route("v2/logging", self._logging, GET),
            Route("v2/logging", self._change_logging, POST),
            Route("v2/trace/setting", self._trace_setting, GET | POST),
            *(
                Route(f"v2/{kind}{region}/{action}", handler, method)
                for kind, handler in (
                    ("systemsharedmemory", self._system_shared_memory),
                    ("cudasharedmemory", self._cuda_shared_memory),
                )
                for region in ("", "/region/{region}")
                for action, method in (("status", GET), ("register", POST), ("unregister", POST))
            ),
            *(
                route
                for prefix in (version, model)
                for route in (
                    Route(prefix, self._model_metadata, GET),
                    Route(f"{prefix}/jobs/**", self._submit_job, POST),
                    Route(f"{prefix}/generate/**", self._generate, POST),
                    Route(f"{prefix}/generate_stream/**", self._generate_stream, POST),
                    Route(f"{prefix}/bulk/**", self._submit_bulk, POST),
                    Route(f"{prefix}/ready/**", self._model_ready, GET),
                    Route(f"{prefix}/config/**", self._model_config, GET),
                    Route(f"{prefix}/stats/**", self._model_statistics, GET),
                    Route(f"{prefix}/trace/setting", self._trace_setting, GET | POST),
                )
            ),
        ]

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            if request.refusal is not None:
                raise PayloadTooLarge(request.refusal)
            refusal = self.precheck(request.method, request.path, request.headers)
            if refusal is not None:
                return refusal
            found = self.router.match(request.method, request.path)
            # Triton's routes take a version of digits alone
            if found is None or not _VERSION.fullmatch(found[1].get("version", "1")):
                raise UnknownRoute(NOT_FOUND)
            endpoint, params = found
            return await endpoint(request, params)
        except Exception as exc:
            return http_error(exc, request)

    def precheck(self, method: str, path: str, headers: dict[bytes, bytes]) -> HttpResponse | None:
        """The answer a request gets whatever its body (403 for a restricted API, 401, or 404
        outside /v2), or None: the HTTP server refuses such a request before an
        `Expect: 100-continue` body."""
        if self.restrictions:
            refusal = self._restricted(path, headers)
            if refusal is not None:
                return refusal
        token = self.auth_token
        if (
            token is not None
            and not path.startswith("/v2/health/")
            and not bearer_matches(headers.get(b"authorization"), token)
        ):
            return error_response(Unauthorized(BEARER_REFUSAL))
        if path.strip("/").split("/", 1)[0] != "v2":
            return error_response(UnknownRoute(NOT_FOUND))
        return None

    def _restricted(self, path: str, headers: dict[bytes, bytes]) -> HttpResponse | None:
        """Triton's 403 for a request to a restricted category without its header."""
        category = http_category(path)
        restriction = self.restrictions.get(category) if category is not None else None
        if restriction is None:
            return None
        if restriction.satisfied_by(headers.get(restriction.header.lower().encode())):
            return None
        return json_response({"error": http_refusal(restriction)}, 403)

    # -- server ------------------------------------------------------------------------------

    async def _server_metadata(self, request: HttpRequest, params: Params) -> HttpResponse:
        return json_response(self.core.server_metadata())

    async def _live(self, request: HttpRequest, params: Params) -> HttpResponse:
        return HttpResponse(200)

    async def _ready(self, request: HttpRequest, params: Params) -> HttpResponse:
        return HttpResponse(200 if self.core.ready() else 400)

    async def _logging(self, request: HttpRequest, params: Params) -> HttpResponse:
        return json_response((await self.core.logging.current()).to_json())

    async def _change_logging(self, request: HttpRequest, params: Params) -> HttpResponse:
        """Triton's answers: a body that is no JSON is a 500, one that is no object changes
        nothing; a refused key answers its status after the keys before it took effect."""
        try:
            changes = _settings_changes(request)
        except _UnparsedSettings as exc:
            return exc.response()
        settings, refused = await self.core.logging.update(changes)
        if refused is not None:
            return json_response({"error": str(refused)}, LOG_REFUSAL_STATUS[refused.kind])
        return json_response(settings.to_json())

    async def _trace_setting(self, request: HttpRequest, params: Params) -> HttpResponse:
        """Triton's trace settings, global or a model's: an update is all or nothing."""
        model = params.get("model")
        if model is not None:
            self.core.known_model(model)
        tracing = self.core.tracing
        if request.method == "GET":
            await tracing.refresh()
            return json_response(tracing.settings(model).to_json())
        try:
            settings = await tracing.update(model, _settings_changes(request))
        except _UnparsedSettings as exc:
            return exc.response()
        except TraceSettingsError as exc:
            return json_response({"error": str(exc)}, exc.status)
        return json_response(settings.to_json())

    async def _fleet(self, request: HttpRequest, params: Params) -> HttpResponse:
        return json_response(await self.core.fleet())

    async def _repository_index(self, request: HttpRequest, params: Params) -> HttpResponse:
        ready = _json_body(request).get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput("'ready' must be a boolean")
        return json_response(await self.core.repository.index(ready_only=ready))

    async def _load_model(self, request: HttpRequest, params: Params) -> HttpResponse:
        name = params["model"]
        config, files = _load_parameters(_parameters(request))
        await self.core.repository.load_model(name, config, files or None)
        return HttpResponse(200)

    async def _unload_model(self, request: HttpRequest, params: Params) -> HttpResponse:
        # Triton 2.51 unloads (200) whatever else the parameter holds: only true is true
        dependents = _parameters(request).get("unload_dependents", False) is True
        await self.core.repository.unload_model(params["model"], dependents)
        return HttpResponse(200)

    async def _all_statistics(self, request: HttpRequest, params: Params) -> HttpResponse:
        return json_response(await self.core.statistics(None, None))

    # -- shared memory -----------------------------------------------------------------------

    async def _system_shared_memory(self, request: HttpRequest, params: Params) -> HttpResponse:
        regions = self.core.shared_memory
        name, action = params.get("region"), request.path.rstrip("/").rsplit("/", 1)[-1]
        if action == "status":
            return json_response(regions.status(name))
        if action == "unregister":
            regions.unregister(name)
            return HttpResponse(200)
        body = _json_body(request)
        for field in ("key", "byte_size"):
            if field not in body:
                raise InvalidInput(f"Shared memory register request has no '{field}' field")
        key, offset, byte_size = body["key"], body.get("offset", 0), body["byte_size"]
        if not isinstance(key, str) or not all(_count(v) for v in (offset, byte_size)):
            raise InvalidInput("'key' must be a string, 'offset' and 'byte_size' unsigned integers")
        regions.register(name or "", key, offset, byte_size)
        return HttpResponse(200)

    async def _cuda_shared_memory(self, request: HttpRequest, params: Params) -> HttpResponse:
        """No GPU at the gateway: what Triton answers when it has no CUDA support."""
        name, action = params.get("region"), request.path.rstrip("/").rsplit("/", 1)[-1]
        if action == "status":
            if name is not None:
                raise RegionNotFound(f"Unable to find cuda shared memory region: '{name}'")
            return json_response([])
        if action == "unregister":
            return HttpResponse(200)
        handle = _json_body(request).get("raw_handle")
        encoded = handle.get("b64") if isinstance(handle, dict) else None
        try:
            valid = len(base64.b64decode(encoded or "", validate=True)) == CUDA_IPC_HANDLE_BYTES
        except (binascii.Error, TypeError, ValueError):
            valid = False
        if not valid:
            raise InvalidInput("'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t")
        raise InvalidInput(
            f"failed to register CUDA shared memory region: '{name}', GPUs not supported"
        )

    # -- models ------------------------------------------------------------------------------

    async def _infer(self, request: HttpRequest, params: Params) -> HttpResponse:
        shared_memory = self.core.shared_memory
        infer = _rest_infer(request)
        infer.shared_memory = shared_memory.read
        outcome = await self.core.infer(
            *(params["model"], params.get("version"), infer, request.disconnected),
            traceparent=self._traceparent(request),
        )
        shared_memory.write_outputs(outcome.request.shm_outputs, outcome.outputs)
        response = infer_response(outcome)
        response.compressible = True  # Triton compresses infer responses alone
        if outcome.trace is not None:
            self.core.tracing.responded(outcome.trace, time.time_ns())
        return response

    async def _generate(self, request: HttpRequest, params: Params) -> HttpResponse:
        return await generate(await self._generated(request, params))

    async def _generate_stream(self, request: HttpRequest, params: Params) -> HttpResponse:
        return await generate_stream(await self._generated(request, params))

    async def _generated(self, request: HttpRequest, params: Params) -> Answers:
        infer, version = _generate_infer(request), params.get("version")
        gone, context = request.disconnected, self._traceparent(request)
        return await self.core.stream(params["model"], version, infer, gone, context)

    def _traceparent(self, request: HttpRequest) -> str | None:
        """The client's trace context (read only when traces follow one)."""
        if not self.core.tracing.follows_context:
            return None
        context = request.headers.get(b"traceparent")
        return context.decode("latin-1") if context else None

    async def _model_metadata(self, request: HttpRequest, params: Params) -> HttpResponse:
        return json_response(await self.core.model_metadata(params["model"], params.get("version")))

    async def _model_ready(self, request: HttpRequest, params: Params) -> HttpResponse:
        await self.core.model_ready(params["model"], params.get("version"))
        return HttpResponse(200)

    async def _model_config(self, request: HttpRequest, params: Params) -> HttpResponse:
        return json_response(await self.core.model_config(params["model"], params.get("version")))

    async def _model_statistics(self, request: HttpRequest, params: Params) -> HttpResponse:
        stats = await self.core.statistics(params["model"], params.get("version"))
        return json_response(stats)

    async def _not_allowed(self, request: HttpRequest, params: Params) -> HttpResponse:
        raise MethodNotAllowed

    # -- jobs --------------------------------------------------------------------------------

    async def _submit_job(self, request: HttpRequest, params: Params) -> HttpResponse:
        state = await self.jobs.submit(params["model"], params.get("version"), _rest_infer(request))
        return _job_state(state)

    async def _get_job(self, request: HttpRequest, params: Params) -> HttpResponse:
        wait_s = _wait_s(request.query)
        found = await self.jobs.get(params["job"], wait_s, request.disconnected)
        if isinstance(found, JobResponses):
            return json_response(found.to_json())
        return infer_response(found) if isinstance(found, InferOutcome) else _job_state(found)

    async def _cancel_job(self, request: HttpRequest, params: Params) -> HttpResponse:
        await self.jobs.cancel(params["job"])
        return json_response({"id": params["job"], "status": "cancelled"})

    async def _job_events(self, request: HttpRequest, params: Params) -> HttpResponse:
        events = await self.jobs.events(params["job"])
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        return HttpResponse(200, headers=headers, stream=_sse(events))

    # -- bulk --------------------------------------------------------------------------------

    async def _submit_bulk(self, request: HttpRequest, params: Params) -> HttpResponse:
        query = dict(parse_qsl(request.query))
        upload = BulkUpload(
            request.body,
            query.get("format"),
            request.headers.get(b"content-type", b"").decode("latin-1"),
            query.get("id"),
            query.get("window"),
        )
        status = await self.core.submit_bulk(params["model"], params.get("version"), upload)
        return _bulk_status(status, 202)

    async def _bulk_status(self, request: HttpRequest, params: Params) -> HttpResponse:
        return _bulk_status(await self.core.bulk.status(params["bulk"]))

    async def _cancel_bulk(self, request: HttpRequest, params: Params) -> HttpResponse:
        return _bulk_status(await self.core.bulk.cancel(params["bulk"]))

    async def _bulk_output(self, request: HttpRequest, params: Params) -> HttpResponse:
        bulk_id = params["bulk"]
        status, data = await self.core.bulk.output(bulk_id)
        if data is None:
            return _bulk_status(status, 202)
        jsonl = status.format == "jsonl"
        extension = "jsonl" if jsonl else "npz"
        headers = [
            (b"content-type", NDJSON if jsonl else NPZ),
            (b"content-disposition", f'attachment; filename="{bulk_id}.{extension}"'.encode()),
        ]
        return HttpResponse(200, data, headers)


#: the size of a CUDA IPC memory handle (cudaIpcMemHandle_t).
CUDA_IPC_HANDLE_BYTES = 64


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
