"""Health probes for an orchestrator: a worker has no HTTP API, so it answers just these two,
on the same HTTP server as the gateway.

GET /v2/health/live is 200 while the process runs; GET /v2/health/ready is 200 once its models
are loaded and its last heartbeat reached Redis, and while no queue's read or recovery loop is
down after a failure (shared/supervision.py), else 503.
"""

from __future__ import annotations

from collections.abc import Callable

from sluice.shared.http_messages import HttpRequest, HttpResponse
from sluice.shared.http_server import Handler, HttpServer

LIVE, READY = "/v2/health/live", "/v2/health/ready"
#: probes carry no body; anything larger is refused before it is read.
MAX_BODY_BYTES = 1024
#: at exit, probes in flight get this long to be answered.
HEALTH_SHUTDOWN_S = 1.0


def health_handler(ready: Callable[[], bool]) -> Handler:
    async def answer(request: HttpRequest) -> HttpResponse:
        if request.path == LIVE:
            return HttpResponse(200)
        if request.path == READY:
            return HttpResponse(200 if ready() else 503)
        return HttpResponse(404)

    return answer


async def serve_health(host: str, port: int, ready: Callable[[], bool]) -> HttpServer:
    server = HttpServer(health_handler(ready), MAX_BODY_BYTES)
    await server.start(host, port)
    return server
