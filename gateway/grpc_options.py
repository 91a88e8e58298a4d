"""The gRPC port's options, apart from the server so that building a gateway's config needs
neither grpcio nor tritonclient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CompressionLevel = Literal["none", "low", "medium", "high"]

#: Triton's default gRPC port.
DEFAULT_GRPC_PORT = 8001


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpcOptions:
    """How the gRPC port serves; port 0 turns gRPC off."""

    port: int = DEFAULT_GRPC_PORT
    #: the largest request message accepted, once decompressed (else RESOURCE_EXHAUSTED).
    max_message_bytes: int = 64 << 20
    #: how much responses are compressed (gzip or deflate, as the client accepts).
    compression: CompressionLevel = "none"
    #: a ModelStreamInfer stream's requests in flight; past them it stops reading.
    stream_max_requests: int = 64
    #: bytes of responses queued for a stream's client; past them its requests wait.
    stream_max_queued_bytes: int = 16 << 20
