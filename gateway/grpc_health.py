"""`grpc.health.v1.Health/Check`, which Triton also serves: what gRPC health probes call
(Kubernetes' `grpc:` probe, grpc_health_probe).

health.proto is not in the tritonclient wheel and the answer is one enum field, so the
response is written as its two wire bytes: field 1 (status), varint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

SERVICE = "grpc.health.v1.Health"
#: HealthCheckResponse{status: SERVING} and {status: NOT_SERVING} on the wire.
SERVING, NOT_SERVING = b"\x08\x01", b"\x08\x02"


def health_handler(ready: Callable[[], bool]) -> Any:
    """The generic handler answering Check with SERVING while `ready()` holds (no token
    needed, as for ServerLive/ServerReady); Watch is not served."""

    async def check(request: bytes, context: Any) -> bytes:
        return SERVING if ready() else NOT_SERVING

    method = grpc.unary_unary_rpc_method_handler(check)
    return grpc.method_handlers_generic_handler(SERVICE, {"Check": method})
