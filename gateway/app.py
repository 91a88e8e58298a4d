"""The KServe v2 HTTP API: one handler from a parsed request to a response.

No framework: routing is a split of the path and a dict lookup, which keeps the per-request
cost to what the protocol needs (see gateway/http_server.py for the measured choice).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import orjson
from sluice.gateway import metadata
from sluice.gateway.bulk_api import BulkApi
from sluice.gateway.dispatcher import Dispatcher, Route
from sluice.gateway.jobs import MAX_WAIT_S, Job, JobStore, new_job_id
from sluice.gateway.model_table import ModelTable, ModelView
from sluice.gateway.outage import RETRY_AFTER_S
from sluice.shared import keys
from sluice.shared.errors import (
    InvalidInput,
    JobNotFound,
    ModelNotReady,
    PayloadTooLarge,
    SluiceError,
    Unauthorized,
    Unavailable,
    error_from_code,
)
from sluice.shared.fleet import fleet_status
from sluice.shared.http_messages import HttpRequest, HttpResponse
from sluice.shared.infer_codec import (
    HEADER_LENGTH,
    ParsedInfer,
    decompress,
    encode_response,
    parse_infer,
)
from sluice.shared.protocol import Request, Result, job_event
from sluice.shared.queue_policy import DEADLINE, PRIORITY, TIMEOUT, deadline_us
from sluice.shared.redis_client import REDIS_ERRORS
from sluice.shared.signature import validate_inputs

log = logging.getLogger(__name__)

JSON = [(b"content-type", b"application/json")]
#: request parameters the workers act on.
FORWARDED_PARAMETERS = (PRIORITY, TIMEOUT, DEADLINE)


@dataclass(frozen=True, slots=True)
class GatewayLimits:
    max_body_bytes: int = 64 << 20
    request_timeout_s: float = 300.0
    #: when set, every request but the health probes needs `Authorization: Bearer <token>`.
    auth_token: str | None = None
    #: how long a job and its result are kept.
    job_ttl_s: int = 3600


def json_response(payload: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(status, orjson.dumps(payload), JSON)


def error_response(error: SluiceError) -> HttpResponse:
    response = json_response({"error": error.message}, error.http_status)
    retry_after_s = getattr(error, "retry_after_s", None)
    if retry_after_s is not None:
        response.headers = [*response.headers, (b"retry-after", b"%d" % retry_after_s)]
    return response


class GatewayApp:
    """The request handler; `dispatcher` and `table` are created by the server before serving."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        table: ModelTable,
        limits: GatewayLimits,
        jobs: JobStore,
        bulk: BulkApi,
    ) -> None:
        self.dispatcher = dispatcher
        self.table = table
        self.limits = limits
        self.jobs = jobs
        self.bulk = bulk

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            if request.refusal is not None:
                raise PayloadTooLarge(request.refusal)
            refusal = self.precheck(request.method, request.path, request.headers)
            return refusal or await self._route(request)
        except SluiceError as exc:
            return error_response(exc)
        except REDIS_ERRORS as exc:  # a read of the fleet's records (fleet, stats) meanwhile
            return error_response(Unavailable(f"Redis is unreachable: {exc}", RETRY_AFTER_S))
        except Exception as exc:  # a bug must still answer, not drop the connection
            log.exception("unhandled error on %s %s", request.method, request.path)
            return json_response({"error": f"internal error: {exc!r}"}, 500)

    def precheck(self, method: str, path: str, headers: dict[bytes, bytes]) -> HttpResponse | None:
        """The answer a request gets whatever its body (401, or 404 outside /v2), or None:
        the HTTP server refuses such a request before an `Expect: 100-continue` body."""
        try:
            self._authorize(path, headers)
        except SluiceError as exc:
            return error_response(exc)
        if path.strip("/").split("/", 1)[0] != "v2":
            return json_response({"error": f"unknown path {path}"}, 404)
        return None

    def _authorize(self, path: str, headers: dict[bytes, bytes]) -> None:
        token = self.limits.auth_token
        if token is None or path.startswith("/v2/health/"):
            return
        given = headers.get(b"authorization", b"")
        if not hmac.compare_digest(given, b"Bearer " + token.encode()):
            raise Unauthorized("missing or invalid bearer token (Authorization: Bearer ...)")

    async def _route(self, request: HttpRequest) -> HttpResponse:
        method, path = request.method, request.path
        rest = path.strip("/").split("/")[1:]  # under /v2 (precheck)
        if not rest or rest == [""]:
            return json_response(metadata.server_metadata())
        if rest[0] == "health" and len(rest) == 2 and rest[1] in ("live", "ready"):
            ok = True if rest[1] == "live" else self.table.ready
            return HttpResponse(200 if ok else 400)
        if rest == ["fleet"] and method == "GET":
            return json_response(await fleet_status(self.dispatcher.redis))
        if rest == ["repository", "index"] and method == "POST":
            return json_response(metadata.repository_index(self.table.models))
        if rest[0] == "jobs" and len(rest) == 2 and method in ("GET", "DELETE"):
            return await self._job_route(method, rest[1], request.query)
        if rest[0] == "jobs" and len(rest) == 3 and rest[2] == "events" and method == "GET":
            return await self._job_events(rest[1])
        if rest[0] == "bulk" and len(rest) >= 2:
            return await self.bulk.route(method, rest[1:])
        if rest[0] == "models" and len(rest) >= 2:
            if rest[1:] == ["stats"]:
                return json_response(
                    await metadata.model_statistics(
                        self.dispatcher.redis, list(self.table.models.values()), None
                    )
                )
            return await self._model_route(request, rest[1], rest[2:])
        return json_response({"error": f"unknown path {path}"}, 404)

    async def _model_route(self, request: HttpRequest, name: str, rest: list[str]) -> HttpResponse:
        version: str | None = None
        if len(rest) >= 2 and rest[0] == "versions":
            version, rest = rest[1], rest[2:]
            if not (version.isascii() and version.isdecimal() and len(version) <= 18):
                raise InvalidInput(f"version must be a number, got '{version[:40]}'")
        action = rest[0] if rest else ""
        view = await self._view(name)
        if action == "infer" and request.method == "POST":
            return await self._infer(view, version, request)
        if action == "jobs" and request.method == "POST":
            return await self._submit_job(view, version, request)
        if action == "bulk" and request.method == "POST":
            content_type = request.headers.get(b"content-type", b"").decode("latin-1")
            resolved = view.resolve_version(version) if version else None
            return await self.bulk.submit(
                view.name, resolved, content_type, request.query, request.body
            )
        if action == "ready":
            ready = (int(version) in view.ready_versions) if version else view.ready
            if ready:
                return HttpResponse(200)
            return json_response({"error": "Model version not ready"}, 400)
        if action == "config":
            if view.config is None:
                raise ModelNotReady(f"model '{name}' is not ready: {view.reason}")
            return json_response(view.config)
        if action == "stats":
            return json_response(
                await metadata.model_statistics(
                    self.dispatcher.redis, [view], int(version) if version else None
                )
            )
        if action == "":
            if view.signature is None:
                raise ModelNotReady(f"model '{name}' is not ready: {view.reason}")
            return json_response(metadata.model_metadata(view, int(version) if version else None))
        return json_response({"error": f"unknown model action '{action}'"}, 404)

    async def _view(self, name: str) -> ModelView:
        if name not in self.table.models:
            try:  # a model registered since the last refresh
                await self.table.refresh()
            except REDIS_ERRORS as exc:
                message = f"queue unavailable: Redis is unreachable ({exc})"
                raise Unavailable(message, RETRY_AFTER_S) from None
        return self.table.get(name)

    def _prepare(
        self, view: ModelView, version_text: str | None, http: HttpRequest
    ) -> tuple[ParsedInfer, int, Route, dict[str, Any]]:
        """Parse and validate an infer body: the parsed request, version, route, parameters."""
        version = view.resolve_version(version_text) or max(view.versions)
        sig = view.signature
        assert sig is not None
        encoding = http.headers.get(b"content-encoding")
        body = decompress(
            http.body, encoding.decode() if encoding else None, self.limits.max_body_bytes
        )
        try:
            parsed = parse_infer(body, _header_length(http.headers), sig)
            validate_inputs(sig, parsed.inputs)
            known = sig.output_names()
            for output in parsed.outputs or ():
                if output not in known:
                    raise InvalidInput(
                        f"unexpected inference output '{output}' for model '{view.name}'"
                    )
            params = {k: v for k, v in parsed.parameters.items() if k in FORWARDED_PARAMETERS}
            policy = view.queue_policy
            level = policy.level_of(params)
            deadline_us(params)
        except InvalidInput:
            self._count_failure(view.name, version, "OTHER")
            raise
        route = Route(
            view.name, level, max(1, sig.max_batch_size), policy.for_level(level).max_queue_size
        )
        return parsed, version, route, params

    async def _infer(
        self, view: ModelView, version_text: str | None, http: HttpRequest
    ) -> HttpResponse:
        parsed, version, route, params = self._prepare(view, version_text, http)
        deadline_s = deadline_us(params) / 1e6
        request = Request(
            self.dispatcher.new_request_id(),
            version,
            time.time_ns(),
            self.dispatcher.reply_stream,
            parsed.inputs,
            tuple(parsed.outputs) if parsed.outputs else None,
            params,
        )

        def client_gone(_: object) -> None:
            self.dispatcher.cancel(view.name, request.id)

        http.disconnected.add_done_callback(client_gone)
        try:
            result = await self.dispatcher.submit(
                route,
                request,
                min(self.limits.request_timeout_s, deadline_s or self.limits.request_timeout_s),
                view.preserve_ordering,
                "Request deadline exceeded" if deadline_s else "Request timeout expired",
            )
        finally:
            http.disconnected.remove_done_callback(client_gone)
        return result_response(view.name, version, parsed, result)

    async def _submit_job(
        self, view: ModelView, version_text: str | None, http: HttpRequest
    ) -> HttpResponse:
        parsed, version, route, params = self._prepare(view, version_text, http)
        job_id = new_job_id(parsed.id)
        request = Request(
            job_id,
            version,
            time.time_ns(),
            keys.job_stream(job_id),
            parsed.inputs,
            tuple(parsed.outputs) if parsed.outputs else None,
            params,
        )
        meta = {
            "model": view.name,
            "version": version,
            "client_id": parsed.id,
            "outputs": parsed.outputs,
            "binary": parsed.binary_output,
        }
        await self.jobs.submit(request, route, meta)
        job = await self.jobs.get(job_id)
        return _job_status(job_id, job)

    async def _job_route(self, method: str, job_id: str, query: str) -> HttpResponse:
        if method == "DELETE":
            job = await self.jobs.get(job_id)
            outcome = await self.jobs.cancel(job_id)
            if outcome < 0 or job is None:
                raise JobNotFound(f"job '{job_id}' is unknown or expired")
            if outcome == 0:
                return json_response({"error": f"job '{job_id}' has already finished"}, 409)
            await self.dispatcher.redis.publish(keys.cancel_channel(job.meta["model"]), job_id)
            await self.dispatcher.redis.publish(
                keys.job_channel(job_id), job_event(job_id, "cancelled")
            )
            return json_response({"id": job_id, "status": "cancelled"})
        wait_s = min(_wait_seconds(query), MAX_WAIT_S)
        job = await self.jobs.get(job_id, wait_s)
        if job is None:
            raise JobNotFound(f"job '{job_id}' is unknown or expired")
        if job.result is None:
            return _job_status(job_id, job)
        meta = job.meta
        parsed = ParsedInfer(meta["client_id"], {}, [], meta["outputs"], meta["binary"])
        return result_response(meta["model"], meta["version"], parsed, job.result)

    async def _job_events(self, job_id: str) -> HttpResponse:
        """Server-sent events: the job's status now, then its result (or error) when done."""
        job = await self.jobs.get(job_id)
        if job is None:
            raise JobNotFound(f"job '{job_id}' is unknown or expired")

        async def events() -> AsyncIterator[bytes]:
            current: Job | None = job
            yield _sse("status", {"id": job_id, "status": job.status})
            while current is not None and current.result is None:
                yield b": waiting\n\n"  # keeps proxies from closing an idle stream
                current = await self.jobs.get(job_id, MAX_WAIT_S)
            if current is None:
                yield _sse("error", {"id": job_id, "error": "job expired"})
                return
            yield _sse("status", {"id": job_id, "status": current.status})
            yield _sse("result", self._job_result_json(current))

        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        return HttpResponse(200, headers=headers, stream=events())

    @staticmethod
    def _job_result_json(job: Job) -> dict[str, Any]:
        assert job.result is not None
        if job.result.error is not None:
            return {"error": job.result.error[1]}
        meta = job.meta
        parsed = ParsedInfer(meta["client_id"], {}, [], meta["outputs"], binary_output=False)
        if parsed.outputs:
            parsed.outputs = dict.fromkeys(parsed.outputs, False)
        body, _ = encode_response(meta["model"], meta["version"], parsed, job.result.outputs)
        assert isinstance(body, bytes)
        return orjson.loads(body)

    def _count_failure(self, model: str, version: int, reason: str) -> None:
        """Failures that never reach a worker still show in the fleet-wide metrics."""
        coro = self.dispatcher.redis.hincrby(keys.GATEWAY_STATS, f"{model}:{version}:{reason}", 1)
        task = asyncio.ensure_future(coro)
        task.add_done_callback(lambda t: t.exception())


def _header_length(headers: dict[bytes, bytes]) -> int | None:
    raw = headers.get(HEADER_LENGTH.encode())
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise InvalidInput("Inference-Header-Content-Length must be an integer") from None
    if value < 0:
        raise InvalidInput("Inference-Header-Content-Length must not be negative")
    return value


def result_response(model: str, version: int, parsed: ParsedInfer, result: Result) -> HttpResponse:
    """The infer response for a result, binary or JSON as the request asked."""
    if result.error is not None:
        raise error_from_code(*result.error)
    body_parts, json_length = encode_response(model, version, parsed, result.outputs)
    if json_length is None:
        return HttpResponse(200, body_parts, JSON)
    return HttpResponse(
        200,
        body_parts,
        [
            (b"content-type", b"application/octet-stream"),
            (HEADER_LENGTH.encode(), str(json_length).encode()),
        ],
    )


def _job_status(job_id: str, job: Job | None) -> HttpResponse:
    status = job.status if job is not None else "queued"
    body = {"id": job_id, "status": status}
    if job is not None:
        body.update(model_name=job.meta["model"], model_version=str(job.meta["version"]))
    headers = [*JSON, (b"location", f"/v2/jobs/{job_id}".encode())]
    return HttpResponse(202, orjson.dumps(body), headers)


def _wait_seconds(query: str) -> float:
    for key, value in parse_qsl(query):
        if key == "wait":
            try:
                wait = float(value)
            except ValueError:
                raise InvalidInput("'wait' must be a number of seconds") from None
            if not wait >= 0:
                raise InvalidInput("'wait' must not be negative")
            return wait
    return 0.0


def _sse(event: str, data: Any) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
