"""The gateway's route table and its one error mapping, without a server."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import redis
from sluice.gateway.app import http_error
from sluice.gateway.outage import RETRY_AFTER_S
from sluice.gateway.routing import MAX_REMEMBERED, Endpoint, Route, Router
from sluice.shared.errors import Conflict, InvalidInput, Unavailable, UnknownRoute
from sluice.shared.http_messages import HttpRequest, HttpResponse


def _endpoint(name: str) -> Endpoint:
    async def endpoint(request: HttpRequest, params: dict[str, str]) -> HttpResponse:
        return HttpResponse(200, name.encode())

    endpoint.__name__ = name
    return endpoint


INFER, META, ACTION, LIVE = (_endpoint(n) for n in ("infer", "meta", "action", "live"))
ROUTER = Router(
    [
        Route("v2/models/{model}/infer/**", INFER, frozenset({"POST"})),
        Route("v2/health/live", LIVE),
        Route("v2/models/{model}", META),
        Route("v2/models/{model}/{action}/**", ACTION),
    ]
)


@pytest.mark.parametrize(
    ("method", "path", "endpoint", "params"),
    [
        ("POST", "/v2/models/m/infer", INFER, {"model": "m"}),
        ("POST", "/v2/models/m/infer/", INFER, {"model": "m"}),
        ("POST", "/v2/models/m/infer/any/more", INFER, {"model": "m"}),
        ("GET", "/v2/models/m/infer", ACTION, {"model": "m", "action": "infer"}),
        ("POST", "/v2/models/m/inferx", ACTION, {"model": "m", "action": "inferx"}),
        ("DELETE", "/v2/health/live", LIVE, {}),
        ("GET", "/v2/models/a b", META, {"model": "a b"}),
        ("GET", "/v2/models//config", ACTION, {"model": "", "action": "config"}),
        ("GET", "/v2/models/m\n/x", ACTION, {"model": "m\n", "action": "x"}),
    ],
)
def test_the_first_route_for_the_method_and_path_wins(
    method: str, path: str, endpoint: object, params: dict[str, str]
) -> None:
    assert ROUTER.match(method, path) == (endpoint, params)


@pytest.mark.parametrize("path", ["/v2/models", "/v2/health/live/x", "/v2/health", "/v3/x"])
def test_a_path_no_route_takes_is_none(path: str) -> None:
    assert ROUTER.match("GET", path) is None


def _body(response: HttpResponse) -> object:
    assert isinstance(response.body, bytes)
    return orjson.loads(response.body)


def _request() -> HttpRequest:
    return HttpRequest("GET", "/v2/x", {}, b"", asyncio.get_running_loop().create_future())


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (InvalidInput("bad"), 400, None),
        (UnknownRoute("bad"), 404, None),
        (Conflict("bad"), 409, None),
        (Unavailable("bad"), 503, None),
        (Unavailable("bad", 7), 503, b"7"),
    ],
)
async def test_typed_errors_map_to_their_status_and_the_kserve_error_body(
    error: Exception, status: int, retry_after: bytes | None
) -> None:
    response = http_error(error, _request())
    assert (response.status, _body(response)) == (status, {"error": "bad"})
    assert dict(response.headers).get(b"retry-after") == retry_after


async def test_redis_away_is_a_503_with_retry_after_and_a_bug_a_500() -> None:
    away = http_error(redis.ConnectionError("refused"), _request())
    assert away.status == 503
    assert dict(away.headers)[b"retry-after"] == b"%d" % RETRY_AFTER_S
    bug = http_error(ValueError("x"), _request())
    assert (bug.status, _body(bug)) == (500, {"error": "internal error: ValueError('x')"})


def test_what_is_remembered_stays_bounded_and_answers_alike() -> None:
    router = Router(ROUTER.routes)
    for i in range(MAX_REMEMBERED + 10):
        assert router.match("GET", f"/v2/models/m{i}") == (META, {"model": f"m{i}"})
    assert len(router._remembered) <= MAX_REMEMBERED
    assert router.match("GET", "/v2/models/m3") == (META, {"model": "m3"})
    assert router.match("GET", "/v2/nothing") is None
    assert router.match("GET", "/v2/nothing") is None
