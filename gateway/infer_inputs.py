"""An infer request as a transport hands it to the gateway core (gateway/core.py): decoded only
once its model is known, since the model's signature says how."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sluice.shared.errors import InvalidInput
from sluice.shared.infer_codec import ParsedInfer, SharedMemoryRead, decompress, parse_infer
from sluice.shared.signature import Signature


class InferInput(Protocol):
    """An infer request as its transport received it, decoded once its model is known."""

    def inflate(self, max_body_bytes: int) -> bytes:
        """The request's bytes, uncompressed (at most `max_body_bytes`)."""
        ...

    def decode(self, body: bytes, sig: Signature) -> ParsedInfer:
        """The request checked against the model's signature (InvalidInput if it does not fit)."""
        ...


@dataclass(slots=True)  # not frozen: one is built per request, and a frozen init costs more
class RestInfer:
    """A KServe v2 REST infer body: JSON, or a JSON header then binary tensors."""

    body: bytes
    #: how the body is compressed (gzip, deflate), if at all.
    encoding: str | None = None
    #: the JSON header's length when binary tensors follow, as sent (unchecked).
    header_length: bytes | None = None
    #: reads inputs from the client's shared memory (None: not on this endpoint).
    shared_memory: SharedMemoryRead | None = None

    def inflate(self, max_body_bytes: int) -> bytes:
        return decompress(self.body, self.encoding, max_body_bytes)

    def decode(self, body: bytes, sig: Signature) -> ParsedInfer:
        return parse_infer(body, _header_length(self.header_length), sig, self.shared_memory)


def _header_length(raw: bytes | None) -> int | None:
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise InvalidInput("Inference-Header-Content-Length must be an integer") from None
    if value < 0:
        raise InvalidInput("Inference-Header-Content-Length must not be negative")
    return value
