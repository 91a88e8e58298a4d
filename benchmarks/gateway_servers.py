"""The gateway on uvicorn or on granian instead of its own HTTP server, for
benchmarks/http_servers.py.

Each class has `HttpServer`'s interface (`start`, `shutdown`, `busy`) and adapts the server's
requests to the gateway's one handler (`HttpRequest` -> `HttpResponse`), so the gateway is
composed exactly as `sluice gateway` composes it: same app, dispatcher and Redis clients.
uvicorn runs with httptools on the gateway's uvloop through a raw ASGI app (no framework);
granian runs embedded in the same loop through RSGI, its native interface.

What the adapters leave to the server: `Expect: 100-continue` (each answers it itself, with
no precheck), gzip of answers (perf_analyzer asks for none), HTTP/1.0 framing and HEAD.

    python benchmarks/gateway_servers.py {uvicorn,granian} <sluice gateway options>
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from typing import Any

import granian.constants
import uvicorn
from granian.log import LogLevels
from granian.server.embed import Server as GranianEmbedded
from sluice.shared.http_messages import HttpRequest, HttpResponse
from sluice.shared.http_server import Handler, Precheck

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

BODY_LIMIT = "request body exceeds the limit of {} bytes"
#: how often a starting granian is asked again whether it listens.
LISTEN_POLL_S = 0.01


def _body(response: HttpResponse) -> bytes:
    body = response.body
    return body if isinstance(body, bytes) else b"".join(body)


class _Handling:
    """What both adapters do between the server and the gateway's handler."""

    def __init__(self, handler: Handler, max_body_bytes: int) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        #: requests being handled (`HttpServer.busy`: what a drain waits for).
        self.busy = 0

    async def handle(
        self,
        method: str,
        path: str,
        query: str,
        headers: dict[bytes, bytes],
        body: bytes,
        disconnected: asyncio.Future[None],
    ) -> HttpResponse:
        """The handler's answer; `disconnected` (the watch on the client) is let go after."""
        refusal = None
        if len(body) > self.max_body_bytes:
            refusal, body = BODY_LIMIT.format(self.max_body_bytes), b""
        # a HEAD is handled as a GET; the server leaves its body out
        method = "GET" if method == "HEAD" else method
        request = HttpRequest(method, path, headers, body, disconnected, refusal, query)
        self.busy += 1
        try:
            return await self.handler(request)
        finally:
            self.busy -= 1
            disconnected.cancel()


class AsgiGateway(_Handling):
    """A raw ASGI app over the gateway's handler."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        message = await receive()
        body = message.get("body", b"")
        if message.get("more_body"):
            chunks = [body]
            while message.get("more_body"):
                message = await receive()
                chunks.append(message.get("body", b""))
            body = b"".join(chunks)
        # after the body, receive() returns only when the client has left
        disconnected = asyncio.ensure_future(receive())
        query = scope["query_string"].decode("latin-1")
        headers = dict(scope["headers"])
        response = await self.handle(
            scope["method"], scope["path"], query, headers, body, disconnected
        )
        start = {"type": "http.response.start", "status": response.status}
        if response.stream is None:
            payload = _body(response)
            start["headers"] = [*response.headers, (b"content-length", b"%d" % len(payload))]
            await send(start)
            await send({"type": "http.response.body", "body": payload})
            return
        start["headers"] = response.headers
        await send(start)
        async for chunk in response.stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


class UvicornServer:
    """`HttpServer`'s interface on uvicorn (httptools, the running uvloop)."""

    def __init__(
        self, handler: Handler, max_body_bytes: int = 64 << 20, precheck: Precheck | None = None
    ) -> None:
        self.app = AsgiGateway(handler, max_body_bytes)
        self._server: uvicorn.Server | None = None
        self._loop: asyncio.Task[None] | None = None

    @property
    def busy(self) -> int:
        return self.app.busy

    async def start(self, host: str, port: int) -> None:
        config = uvicorn.Config(
            self.app, host, port, http="httptools", lifespan="off", log_level="warning",
            access_log=False, backlog=4096,
        )  # fmt: skip
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup()  # binds; the signals stay the gateway's
        self._server = server
        self._loop = asyncio.create_task(server.main_loop())

    async def shutdown(self, timeout_s: float, *_: object) -> None:
        if self._server is None or self._loop is None:
            return
        self._server.should_exit = True
        await self._loop
        self._server.config.timeout_graceful_shutdown = max(1, int(timeout_s))
        await self._server.shutdown()


class RsgiGateway(_Handling):
    """An RSGI app over the gateway's handler."""

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        body = await protocol()
        disconnected = asyncio.ensure_future(protocol.client_disconnect())
        headers = {name.encode(): value.encode() for name, value in scope.headers.items()}
        response = await self.handle(
            scope.method, scope.path, scope.query_string, headers, body, disconnected
        )
        answer = [(name.decode(), value.decode()) for name, value in response.headers]
        if response.stream is None:
            protocol.response_bytes(response.status, answer, _body(response))
            return
        transport = protocol.response_stream(response.status, answer)
        async for chunk in response.stream:
            await transport.send_bytes(chunk)


class GranianServer:
    """`HttpServer`'s interface on granian, embedded in the running loop (RSGI)."""

    def __init__(
        self, handler: Handler, max_body_bytes: int = 64 << 20, precheck: Precheck | None = None
    ) -> None:
        self.app = RsgiGateway(handler, max_body_bytes)
        self._server: GranianEmbedded | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def busy(self) -> int:
        return self.app.busy

    async def start(self, host: str, port: int) -> None:
        self._server = GranianEmbedded(
            self.app,
            address=host,
            port=port,
            interface=granian.constants.Interfaces.RSGI,
            http=granian.constants.HTTPModes.http1,
            websockets=False,
            backlog=4096,
            log_level=LogLevels.warning,
        )
        self._task = asyncio.create_task(self._server.serve())
        await self._until_listening(host, port)

    async def _until_listening(self, host: str, port: int, timeout_s: float = 10.0) -> None:
        """granian binds on a thread of its own and says nothing when it has: connect until
        it answers (or its task ends, which re-raises why)."""
        assert self._task is not None
        deadline_s = asyncio.get_running_loop().time() + timeout_s
        while True:
            if self._task.done():
                self._task.result()
                raise RuntimeError("granian stopped before it listened")
            try:
                _, writer = await asyncio.open_connection(host, port)
            except OSError:
                if asyncio.get_running_loop().time() > deadline_s:
                    raise
                await asyncio.sleep(LISTEN_POLL_S)
                continue
            writer.close()
            return

    async def shutdown(self, timeout_s: float, *_: object) -> None:
        if self._server is None or self._task is None:
            return
        self._server.stop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._task, timeout_s)


SERVERS = {"uvicorn": UvicornServer, "granian": GranianServer}


def main() -> None:
    """`sluice gateway` with its HTTP server replaced by the one named first."""
    import sluice.gateway.server

    from sluice.cli import main as cli

    name, options = sys.argv[1], sys.argv[2:]
    sluice.gateway.server.HttpServer = SERVERS[name]  # type: ignore[misc,assignment]  # same interface
    sys.argv = ["sluice", "gateway", *options]
    cli()


if __name__ == "__main__":
    main()
