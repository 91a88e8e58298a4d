"""Triton's restricted APIs: endpoint groups that answer only requests carrying a header.

`--http-restricted-api <categories>:<key>=<value>` and `--grpc-restricted-protocol
<categories>:<key>=<value>` (Triton 2.51, src/command_line_parser.cc): a request to an
endpoint of a listed category must carry header `<key>` (HTTP; the name in any case, as
libevhtp finds headers) or metadata `triton-grpc-protocol-<key>` (gRPC) equal to `<value>`,
or it is refused with Triton's status and text. Parse errors are Triton's texts too.

sluice's own routes go to the category whose work they do: jobs and bulk jobs run inferences
(inference), `/v2/fleet` describes the server (metadata).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: Triton's categories (src/restricted_features.h), in its order.
CATEGORIES = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
)
#: gRPC: the metadata key is this prefix and the flag's key (grpc_server.h).
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"


@dataclass(frozen=True, slots=True)
class Restriction:
    """The header a restricted category's requests must carry, and its value."""

    header: str
    value: str

    def satisfied_by(self, given: bytes | str | None) -> bool:
        if given is None:
            return False
        raw = given.encode() if isinstance(given, str) else given
        return hmac.compare_digest(raw, self.value.encode())


#: category -> its restriction; a category not in it is open.
Restrictions = Mapping[str, Restriction]


def parse_restrictions(
    specs: Iterable[str], option: str, kind: str, header_prefix: str = ""
) -> dict[str, Restriction]:
    """The restrictions of every `<categories>:<key>=<value>` given to `option` (repeated);
    ValueError with Triton's text for a malformed one, an unknown category (`kind` is
    "api" or "protocol", as Triton words it) or a category in two groups."""
    restrictions: dict[str, Restriction] = {}
    for spec in specs:
        names, colon, setting = spec.partition(":")
        key, equals, value = setting.partition("=")
        if not (colon and equals and names and key and value):
            raise ValueError(
                f"{option} option format is '<config name>:<setting>=<value>'. Got {spec}"
            )
        for category in names.split(","):
            if category not in CATEGORIES:
                raise ValueError(f"unknown restricted {kind} '{category}'")
            if category in restrictions:
                raise ValueError(
                    f"restricted {kind} '{category}' can not be specified in multiple config groups"
                )
            restrictions[category] = Restriction(header_prefix + key, value)
    return restrictions


def http_refusal(restriction: Restriction) -> str:
    """Triton's text for an HTTP request without the header (status 403)."""
    return f"This API is restricted, expecting header '{restriction.header}'"


def grpc_refusal(restriction: Restriction) -> str:
    """Triton's text for an RPC without the metadata (status UNAVAILABLE)."""
    return f"This protocol is restricted, expecting header '{restriction.header}'"


#: a model's action (the path segment after the model, or its version) -> its category.
_MODEL_ACTIONS = {
    "ready": "health",
    "infer": "inference",
    "generate": "inference",
    "generate_stream": "inference",
    "jobs": "inference",
    "bulk": "inference",
    "config": "model-config",
    "stats": "statistics",
    "trace": "trace",
}
#: the first path segment after /v2 -> its category, for paths outside /v2/models.
_SERVER_PATHS = {
    "health": "health",
    "fleet": "metadata",
    "repository": "model-repository",
    "systemsharedmemory": "shared-memory",
    "cudasharedmemory": "shared-memory",
    "trace": "trace",
    "logging": "logging",
    "jobs": "inference",
    "bulk": "inference",
}


def http_category(path: str) -> str | None:
    """The category of a /v2 path (the router's view: outer slashes dropped), or None for a
    path no endpoint serves. Triton's CUDA shared memory paths, which sluice answers as a
    Triton without GPUs, have theirs too, so that a restricted one is refused as Triton
    refuses it."""
    segments = path.strip("/").split("/")
    if segments[0] != "v2":
        return None
    if len(segments) == 1:
        return "metadata"
    if segments[1] != "models":
        return _SERVER_PATHS.get(segments[1])
    rest = segments[2:]
    if rest == ["stats"]:
        return "statistics"
    if not rest:
        return None
    rest = rest[1:]  # the model's name
    if len(rest) >= 2 and rest[0] == "versions":
        rest = rest[2:]
    return "metadata" if not rest else _MODEL_ACTIONS.get(rest[0])


#: `inference.GRPCInferenceService`'s RPCs and the health check -> their category
#: (src/grpc/grpc_server.cc).
GRPC_CATEGORIES = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "Check": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory",
    "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory",
    "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory",
    "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}


def grpc_category(method: str) -> str | None:
    """The category of an RPC by its full name (`/inference.GRPCInferenceService/ModelInfer`)."""
    return GRPC_CATEGORIES.get(method.rpartition("/")[2])
