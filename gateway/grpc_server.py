"""The gateway's gRPC port: grpcio's asyncio server running the servicer of grpc_app.py on
the gateway's own event loop, beside the HTTP server."""

from __future__ import annotations

from typing import Any

import grpc
from sluice.gateway.core import GatewayCore
from sluice.gateway.grpc_app import InferenceServicer
from sluice.gateway.grpc_health import health_handler
from sluice.gateway.grpc_options import GrpcOptions
from tritonclient.grpc import service_pb2_grpc

#: grpc core's compression levels (grpc_compression_level), as Triton's option names them.
COMPRESSION_LEVELS: dict[str, int] = {"none": 0, "low": 1, "medium": 2, "high": 3}


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcPort:
    """`inference.GRPCInferenceService` and the gRPC health check on one port. Built while
    the gateway starts up (so that what grpcio allocates is settled with the rest), listening
    from `start()`."""

    def __init__(
        self, core: GatewayCore, options: GrpcOptions, host: str, auth_token: str | None
    ) -> None:
        self.address = _address(host, options.port)
        self._started = False
        self.server: Any = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", options.max_message_bytes),
                ("grpc.max_send_message_length", -1),
                # a port already taken must fail here, not be shared with its owner
                ("grpc.so_reuseport", 0),
                ("grpc.default_compression_level", COMPRESSION_LEVELS[options.compression]),
            ]
        )
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceServicer(core, auth_token), self.server
        )
        self.server.add_generic_rpc_handlers((health_handler(core.ready),))

    async def start(self) -> None:
        try:
            self.server.add_insecure_port(self.address)
        except RuntimeError as exc:
            message = f"cannot listen for gRPC on {self.address} (--grpc-port): {exc}"
            raise OSError(message) from None
        await self.server.start()
        self._started = True

    async def stop(self, grace_s: float) -> None:
        """Take no new call; calls in flight have `grace_s` to finish, then are cancelled."""
        if self._started:
            await self.server.stop(grace_s)
