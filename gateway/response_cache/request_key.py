"""The key a request's response is cached under.

Triton hashes the model's name and version and each input, by name, with its bytes; sluice also
hashes each input's datatype and shape (as Triton's guide says it does) and the outputs asked
for, so that a request never gets a response of another shape or with other outputs. The
digest is of the decoded tensors, so HTTP JSON, HTTP binary and gRPC requests with the same
tensors share an entry, as on Triton.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from hashlib import blake2b

from sluice.shared.protocol import Tensor

#: 128 bits: a collision is far less likely than with Triton's 64-bit hash.
DIGEST_BYTES = 16


def request_key(
    model: str, version: int, inputs: Sequence[Tensor], outputs: Iterable[str] | None
) -> bytes:
    """The digest of everything that decides a response (not the request's parameters, as
    in Triton)."""
    digest = blake2b(digest_size=DIGEST_BYTES)
    digest.update(f"{model}\0{version}\0".encode())
    for tensor in sorted(inputs, key=lambda t: t.name):
        data = memoryview(tensor.data).cast("B")
        head = f"{tensor.name}\0{tensor.datatype}\0{tensor.shape}\0{data.nbytes}\0"
        digest.update(head.encode())
        digest.update(data)
    if outputs is not None:
        digest.update(b"\1" + "\0".join(sorted(outputs)).encode())
    return digest.digest()
