"""benchmarks/gateway_servers.py: uvicorn and granian hand the gateway's handler the request
its own server would, and send back its answer, so benchmarks/http_servers.py compares
servers, not two different gateways. Real servers on loopback; skipped without the [bench]
extra."""

from __future__ import annotations

import asyncio
import http.client
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sluice.shared.http_messages import HttpRequest, HttpResponse

from tests.conftest import free_port

pytest.importorskip("uvicorn")
pytest.importorskip("granian")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gateway_servers

MAX_BODY_BYTES = 1024


async def echo(request: HttpRequest) -> HttpResponse:
    """Answers with what it was handed; /events streams two chunks."""
    if request.path == "/events":

        async def chunks() -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"

        return HttpResponse(200, headers=[(b"content-type", b"text/event-stream")], stream=chunks())
    status = 413 if request.refusal else 200
    seen = f"{request.method} {request.path} ?{request.query} {request.headers.get(b'x-tag')!r}"
    return HttpResponse(status, [seen.encode(), b" | ", request.body], [(b"x-seen", b"1")])


def call(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes, str | None]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, body=body, headers={"X-Tag": "t"})
        response = connection.getresponse()
        return response.status, response.read(), response.getheader("x-seen")
    finally:
        connection.close()


@pytest.mark.parametrize("name", sorted(gateway_servers.SERVERS))
async def test_the_handler_sees_the_request_and_its_answer_is_sent(name: str) -> None:
    server = gateway_servers.SERVERS[name](echo, MAX_BODY_BYTES)
    port = free_port()
    await server.start("127.0.0.1", port)
    try:
        post = await asyncio.to_thread(call, port, "POST", "/v2/a%20b?x=1", b"payload")
        assert post == (200, b"POST /v2/a b ?x=1 b't' | payload", "1")
        head = await asyncio.to_thread(call, port, "HEAD", "/v2")
        assert head == (200, b"", "1")  # handled as a GET, sent without its body
        large = await asyncio.to_thread(call, port, "POST", "/v2", b"x" * (MAX_BODY_BYTES + 1))
        assert large[0] == 413
        assert large[1].endswith(b" | ")  # the body over the limit is not handed on
        events = await asyncio.to_thread(call, port, "GET", "/events")
        assert events[:2] == (200, b"data: 1\n\ndata: 2\n\n")
        assert server.busy == 0
    finally:
        await server.shutdown(5.0)
