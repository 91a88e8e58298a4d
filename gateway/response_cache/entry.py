"""A cached response as bytes: its outputs and its parameters, in one msgpack value."""

from __future__ import annotations

from collections.abc import Sequence

import msgpack
from sluice.shared.protocol import ResponseParameter, Tensor


def pack_entry(outputs: Sequence[Tensor], parameters: dict[str, ResponseParameter] | None) -> bytes:
    return msgpack.packb(
        [
            [[t.name, t.datatype, list(t.shape), memoryview(t.data).cast("B")] for t in outputs],
            parameters,
        ]
    )


def unpack_entry(raw: bytes) -> tuple[list[Tensor], dict[str, ResponseParameter] | None]:
    outputs, parameters = msgpack.unpackb(raw)
    return [Tensor(name, dtype, tuple(shape), data) for name, dtype, shape, data in outputs], (
        parameters
    )
