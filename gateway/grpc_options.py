"""The gRPC port's options, apart from the server so that building a gateway's config needs
neither grpcio nor tritonclient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CompressionLevel = Literal["none", "low", "medium", "high"]
#: which server carries the gRPC port: sluice's own HTTP/2 on the gateway's event loop
#: (gateway/grpc_h2), or grpcio's asyncio server (gateway/grpc_server.py).
GrpcServer = Literal["sluice", "grpcio"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpcOptions:
    """How the gRPC port serves, from the settings' --grpc-* options (which hold their
    defaults); port 0 turns gRPC off."""

    port: int
    #: the largest request message accepted, once decompressed (else RESOURCE_EXHAUSTED).
    max_message_bytes: int
    #: how much responses are compressed (gzip or deflate, as the client accepts).
    compression: CompressionLevel
    #: a ModelStreamInfer stream's requests in flight; past them it stops reading.
    stream_max_requests: int
    #: bytes of responses queued for a stream's client; past them its requests wait.
    stream_max_queued_bytes: int
    #: the server that carries the port.
    server: GrpcServer = "sluice"
