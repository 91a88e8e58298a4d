"""A gzip or deflate body inflates only up to --max-body-bytes: a bomb is a 413, not memory."""

from __future__ import annotations

import gzip
import http.client
import json
import tracemalloc
import zlib

import pytest
from sluice.shared.errors import InvalidInput, PayloadTooLarge
from sluice.shared.infer_codec import decompress

from tests.conftest import Service

MIB = 1 << 20
ENCODINGS = ["gzip", "deflate"]


def _bomb(encoding: str, size: int) -> bytes:
    """`size` zero bytes, compressed (about a thousandth of that on the wire)."""
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    compressor = zlib.compressobj(9, zlib.DEFLATED, wbits)
    zeros = bytes(MIB)
    return b"".join(compressor.compress(zeros) for _ in range(size // MIB)) + compressor.flush()


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_inflating_stops_at_the_limit_without_holding_the_rest(encoding: str) -> None:
    body = _bomb(encoding, 64 * MIB)
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge, match=f"inflates past the limit of {MIB} bytes"):
            decompress(body, encoding, max_bytes=MIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * MIB


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_body_inflating_to_exactly_the_limit_is_whole(encoding: str) -> None:
    assert decompress(_bomb(encoding, MIB), encoding, max_bytes=MIB) == bytes(MIB)


def test_a_truncated_body_is_a_400() -> None:
    with pytest.raises(InvalidInput, match="body is not valid gzip: it ends early"):
        decompress(gzip.compress(b"x" * 1000)[:-12], "gzip", max_bytes=MIB)


def test_a_gzip_bomb_gets_a_413_from_the_gateway(service: Service) -> None:
    host, port = service.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(
        "POST",
        "/v2/models/nobatch/infer",
        body=_bomb("gzip", 128 * MIB),  # twice the default --max-body-bytes
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    response = conn.getresponse()
    message = json.loads(response.read())["error"]
    conn.close()
    assert response.status == 413
    assert message == (
        f"request body inflates past the limit of {64 * MIB} bytes (--max-body-bytes)"
    )
