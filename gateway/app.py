"""The KServe v2 HTTP API: one handler from a parsed request to a response.

No framework: routing is a split of the path and a dict lookup, which keeps the per-request
cost to what the protocol needs (see gateway/http_server.py for the measured choice).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson

from gateway import metadata
from gateway.dispatcher import Dispatcher, Route
from gateway.http_server import HttpRequest, HttpResponse
from gateway.infer_codec import HEADER_LENGTH, decompress, encode_response, parse_infer
from gateway.model_table import ModelTable, ModelView
from shared import keys
from shared.errors import (
    InvalidInput,
    ModelNotReady,
    SluiceError,
    Unauthorized,
    Unavailable,
    error_from_code,
)
from shared.protocol import Request
from shared.queue_policy import DEADLINE, PRIORITY, TIMEOUT, deadline_us
from shared.signature import validate_inputs

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


def json_response(payload: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(status, orjson.dumps(payload), JSON)


def error_response(error: SluiceError) -> HttpResponse:
    return json_response({"error": error.message}, error.http_status)


class GatewayApp:
    """The request handler; `dispatcher` and `table` are created by the server before serving."""

    def __init__(self, dispatcher: Dispatcher, table: ModelTable, limits: GatewayLimits) -> None:
        self.dispatcher = dispatcher
        self.table = table
        self.limits = limits

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            if request.refusal is not None:
                raise InvalidInput(request.refusal)
            self._authorize(request.path, request.headers)
            return await self._route(request)
        except SluiceError as exc:
            return error_response(exc)
        except Exception as exc:  # a bug must still answer, not drop the connection
            log.exception("unhandled error on %s %s", request.method, request.path)
            return json_response({"error": f"internal error: {exc!r}"}, 500)

    def _authorize(self, path: str, headers: dict[bytes, bytes]) -> None:
        token = self.limits.auth_token
        if token is None or path.startswith("/v2/health/"):
            return
        given = headers.get(b"authorization", b"")
        if not hmac.compare_digest(given, b"Bearer " + token.encode()):
            raise Unauthorized("missing or invalid bearer token (Authorization: Bearer ...)")

    async def _route(self, request: HttpRequest) -> HttpResponse:
        method, path = request.method, request.path
        parts = path.strip("/").split("/")
        if parts[0] != "v2":
            return json_response({"error": f"unknown path {path}"}, 404)
        rest = parts[1:]
        if not rest or rest == [""]:
            return json_response(metadata.server_metadata())
        if rest[0] == "health" and len(rest) == 2 and rest[1] in ("live", "ready"):
            ok = True if rest[1] == "live" else self.table.ready
            return HttpResponse(200 if ok else 400)
        if rest == ["repository", "index"] and method == "POST":
            return json_response(metadata.repository_index(self.table.models))
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
            await self.table.refresh()  # a model registered since the last refresh
        return self.table.get(name)

    async def _infer(
        self,
        view: ModelView,
        version_text: str | None,
        http: HttpRequest,
    ) -> HttpResponse:
        if not self.table.reachable:
            raise Unavailable("queue unavailable: Redis is unreachable")
        version = view.resolve_version(version_text) or max(view.versions)
        sig = view.signature
        assert sig is not None
        headers = http.headers
        encoding = headers.get(b"content-encoding")
        body = http.body
        body = decompress(body, encoding.decode() if encoding else None)
        header_length = _header_length(headers)
        try:
            parsed = parse_infer(body, header_length, sig)
            validate_inputs(sig, parsed.inputs)
            if parsed.outputs:
                known = set(sig.output_names())
                for output in parsed.outputs:
                    if output not in known:
                        raise InvalidInput(
                            f"unexpected inference output '{output}' for model '{view.name}'"
                        )
        except InvalidInput:
            self._count_failure(view.name, version, "OTHER")
            raise
        params = {k: v for k, v in parsed.parameters.items() if k in FORWARDED_PARAMETERS}
        policy = view.queue_policy
        try:
            level = policy.level_of(params)
            deadline_s = deadline_us(params) / 1e6
        except InvalidInput:
            self._count_failure(view.name, version, "OTHER")
            raise
        request = Request(
            self.dispatcher.new_request_id(),
            version,
            time.time_ns(),
            self.dispatcher.reply_stream,
            parsed.inputs,
            tuple(parsed.outputs) if parsed.outputs else None,
            params,
        )
        route = Route(
            view.name, level, max(1, sig.max_batch_size), policy.for_level(level).max_queue_size
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
        if result.error is not None:
            raise error_from_code(*result.error)
        body_parts, json_length = encode_response(view.name, version, parsed, result.outputs)
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
