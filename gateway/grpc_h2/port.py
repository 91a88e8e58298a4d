"""The gateway's gRPC port on its own HTTP/2 (gateway/grpc_h2): the same servicer and health
check as grpcio's server (gateway/grpc_server.py) serves, on the gateway's event loop with no
threads, at a fraction of grpcio's cost per call (benchmarks/RESULTS.md, "gRPC on the
gateway's own HTTP/2")."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from sluice.gateway.core import GatewayCore, GatewayLimits
from sluice.gateway.grpc_h2.calls import Service
from sluice.gateway.grpc_h2.connection import Connection
from sluice.gateway.grpc_health import SERVICE as HEALTH_SERVICE
from sluice.gateway.grpc_health import health_handler
from sluice.gateway.grpc_options import GrpcOptions
from sluice.gateway.grpc_server import SERVICE, inference_servicer, service_handlers
from sluice.gateway.stream_window import StreamLoad

#: connections waiting for a GOAWAY's streams to end are closed this long after the grace.
CLOSE_S = 1.0


class _Details:
    """grpcio's handler call details, as a generic handler is asked for a method."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def methods(
    core: GatewayCore, limits: GatewayLimits, options: GrpcOptions, streams: StreamLoad
) -> dict[str, Any]:
    """Each RPC's handler by its path: the inference service's and the health check's."""
    servicer = inference_servicer(core, limits, options, streams)
    handlers = {
        f"/{SERVICE.full_name}/{name}": handler
        for name, handler in service_handlers(servicer).items()
    }
    check = f"/{HEALTH_SERVICE}/Check"
    handlers[check] = health_handler(core.ready).service(_Details(check))
    return handlers


class H2GrpcPort:
    """The gRPC port, listening from `start()`."""

    def __init__(
        self,
        core: GatewayCore,
        options: GrpcOptions,
        host: str,
        limits: GatewayLimits,
        streams: StreamLoad,
        share_port: bool = False,
    ) -> None:
        self.host = host
        self.port = options.port
        self.share_port = share_port
        self.service = Service(
            methods(core, limits, options, streams),
            limits.grpc_restrictions,
            options.max_message_bytes,
            options.compression,
        )
        self.connections: set[Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: Connection(self.service.new_call, self.connections),
                self.host,
                self.port,
                backlog=4096,
                reuse_address=True,
                reuse_port=self.share_port or None,
            )
        except OSError as exc:
            message = f"cannot listen for gRPC on {self.host}:{self.port} (--grpc-port): {exc}"
            raise OSError(message) from None

    async def stop(self, grace_s: float) -> None:
        """Take no new call (GOAWAY); calls in flight have `grace_s` to finish, then their
        connections close."""
        if self._server is None:
            return
        self._server.close()
        for connection in list(self.connections):
            connection.close()
        waits = [asyncio.ensure_future(c.idle.wait()) for c in list(self.connections)]
        if waits:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waits), grace_s)
        for connection in list(self.connections):
            connection.abort()
        for wait in waits:
            wait.cancel()
