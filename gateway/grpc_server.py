"""The gateway's gRPC port: grpcio's asyncio server running the servicer of grpc_app.py on
the gateway's own event loop, beside the HTTP server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from sluice.gateway.core import GatewayCore, GatewayLimits
from sluice.gateway.grpc_app import InferenceServicer
from sluice.gateway.grpc_health import health_handler
from sluice.gateway.grpc_options import GrpcOptions
from sluice.gateway.restricted_apis import Restriction, Restrictions, grpc_category, grpc_refusal
from sluice.gateway.stream_window import StreamLoad, StreamWindow
from tritonclient.grpc import service_pb2 as pb

#: grpc core's compression levels (grpc_compression_level), as Triton's option names them.
COMPRESSION_LEVELS: dict[str, int] = {"none": 0, "low": 1, "medium": 2, "high": 3}

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
Status = grpc.StatusCode

#: the RPCs grpc core matches as registered methods (the rest reach the servicer through the
#: generic handler). grpc.aio keeps one pending call per registered method and, for every
#: call it accepts, waits on all of them (asyncio.wait): registering the service's twenty RPCs,
#: as the generated `add_..._to_server` does, costs every call about 13 µs more than one.
REGISTERED_RPCS = ("ModelInfer",)

#: (client streams, server streams) -> the handler kind.
HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def service_handlers(servicer: InferenceServicer) -> dict[str, Any]:
    """The service's method handlers, from its descriptor: each RPC to the servicer's method
    of that name, with its messages' parser and serializer. A unary request whose bytes are
    not its message is refused with INVALID_ARGUMENT (grpcio would answer UNKNOWN)."""
    handlers = {}
    for method in SERVICE.methods:
        behavior = getattr(servicer, method.name)
        parse = getattr(pb, method.input_type.name).FromString
        if not method.client_streaming:
            behavior, parse = _refusing_undecodable(behavior), _decoder(parse)
        handlers[method.name] = HANDLER_KINDS[method.client_streaming, method.server_streaming](
            behavior,
            request_deserializer=parse,
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    return handlers


def inference_servicer(
    core: GatewayCore, limits: GatewayLimits, options: GrpcOptions, streams: StreamLoad
) -> InferenceServicer:
    """The servicer either server runs, its streams bounded as the options say."""
    window = partial(
        StreamWindow, options.stream_max_requests, options.stream_max_queued_bytes, streams
    )
    return InferenceServicer(core, limits.auth_token, window)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """Request bytes that do not parse as the RPC's message, and why."""

    error: str


def _decoder(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return Undecodable(f"the request is not a valid message of its RPC: {exc}")

    return decode


def _refusing_undecodable(
    behavior: Callable[[Any, Any], Awaitable[Any]],
) -> Callable[[Any, Any], Awaitable[Any]]:
    async def call(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(Status.INVALID_ARGUMENT, request.error)
        return await behavior(request, context)

    return call


class RestrictedProtocols(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Triton's --grpc-restricted-protocol: an RPC of a restricted category without its
    `triton-grpc-protocol-<key>` metadata is refused with UNAVAILABLE before its handler runs
    (Triton: src/grpc/grpc_server.cc)."""

    def __init__(self, restrictions: Restrictions) -> None:
        self.restrictions = restrictions

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        handler = await continuation(handler_call_details)
        category = grpc_category(handler_call_details.method)
        restriction = self.restrictions.get(category) if category is not None else None
        if handler is None or restriction is None:
            return handler
        for key, value in handler_call_details.invocation_metadata or ():
            if key == restriction.header and restriction.satisfied_by(value):
                return handler
        return _refusal(handler, restriction)


def _refusal(handler: Any, restriction: Restriction) -> Any:
    """A handler of `handler`'s kind that answers Triton's refusal without reading the request."""

    async def refuse(request: Any, context: Any) -> None:
        await context.abort(Status.UNAVAILABLE, grpc_refusal(restriction))

    return HANDLER_KINDS[handler.request_streaming, handler.response_streaming](refuse)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcPort:
    """`inference.GRPCInferenceService` and the gRPC health check on one port. Built while
    the gateway starts up (so that what grpcio allocates is settled with the rest), listening
    from `start()`."""

    def __init__(
        self,
        core: GatewayCore,
        options: GrpcOptions,
        host: str,
        limits: GatewayLimits,
        streams: StreamLoad,
        share_port: bool = False,
    ) -> None:
        self.address = _address(host, options.port)
        self._started = False
        restricted = limits.grpc_restrictions
        self.server: Any = grpc.aio.server(
            interceptors=[RestrictedProtocols(restricted)] if restricted else None,
            options=[
                ("grpc.max_receive_message_length", options.max_message_bytes),
                ("grpc.max_send_message_length", -1),
                # a port already taken must fail here, not be shared with its owner, unless
                # the gateways of this host share it on purpose (serve --gateways)
                ("grpc.so_reuseport", 1 if share_port else 0),
                ("grpc.default_compression_level", COMPRESSION_LEVELS[options.compression]),
            ],
        )
        handlers = service_handlers(inference_servicer(core, limits, options, streams))
        generic = grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)
        self.server.add_generic_rpc_handlers((generic, health_handler(core.ready)))
        registered = {name: handlers[name] for name in REGISTERED_RPCS}
        self.server.add_registered_method_handlers(SERVICE.full_name, registered)

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
