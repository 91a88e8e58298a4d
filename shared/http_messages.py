"""HTTP requests and answers as plain values, and the one place a typed error becomes an answer.

Shared by the gateway's API and the worker's health probes, which run on the same server
(shared/http_server.py).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import orjson
from sluice.shared.errors import SluiceError

JSON = [(b"content-type", b"application/json")]
REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    headers: dict[bytes, bytes]
    body: bytes
    #: resolves when the client closes its connection (the request may be dropped then).
    disconnected: asyncio.Future[None]
    #: set when the body was over the size limit (and dropped): why it is refused (413).
    refusal: str | None = None
    #: the raw query string (after `?`).
    query: str = ""


@dataclass(slots=True)
class HttpResponse:
    status: int
    body: bytes | list[bytes | bytearray | memoryview] = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    #: a body written piece by piece as it is produced (server-sent events), chunked.
    stream: AsyncIterator[bytes] | None = None
    #: an infer response: compressed in the coding the client's Accept-Encoding prefers.
    #: Triton compresses no other answer, and clients (aiohttp under tritonclient's asyncio
    #: client) that accept gzip on every request inflate infer responses alone.
    compressible: bool = False


def json_response(payload: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(status, orjson.dumps(payload), JSON)


def error_response(error: SluiceError) -> HttpResponse:
    """The KServe v2 error body `{"error": message}` with the error's status; Retry-After when
    the error says when to retry (so that clients and proxies back off)."""
    response = json_response({"error": error.message}, error.http_status)
    retry_after_s = getattr(error, "retry_after_s", None)
    if retry_after_s is not None:
        response.headers = [*response.headers, (b"retry-after", b"%d" % retry_after_s)]
    return response


#: zlib's window bits for each coding an answer may be sent in (deflate: the zlib format).
_WBITS = {b"gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
_CODINGS = (b"identity", *_WBITS)


def response_coding(accept_encoding: bytes) -> bytes | None:
    """The coding of identity, gzip and deflate that Accept-Encoding weighs highest (q, 1 when
    not given; the first of equal weights), as Triton picks it; None: the body as it is."""
    best, best_weight = None, 0.0
    for item in accept_encoding.split(b","):
        name, _, weight_text = item.partition(b";")
        name = name.strip().lower()
        if name not in _CODINGS:
            continue
        weight = 1.0
        if weight_text:
            key, _, value = weight_text.partition(b"=")
            if key.strip().lower() != b"q":
                continue
            try:
                weight = float(value)
            except ValueError:
                continue
        if weight > best_weight:
            best, best_weight = name, weight
    return None if best == b"identity" else best


def encode_response(
    response: HttpResponse,
    accept_encoding: bytes,
    keep_alive: bool,
    version: bytes = b"1.1",
    head: bool = False,
) -> bytes:
    """Status line, headers and body as one buffer (one write, one syscall).

    `version`: the client's (1.0 or 1.1); `head`: a HEAD request's answer, all but the body.
    """
    body = response.body
    if isinstance(body, list):
        body = b"".join(body)
    headers = response.headers
    coding = response_coding(accept_encoding) if body and response.compressible else None
    if coding is not None:
        compressor = zlib.compressobj(wbits=_WBITS[coding])
        body = compressor.compress(body) + compressor.flush()
        headers = [*headers, (b"content-encoding", coding)]
    status = response.status
    lines = [b"HTTP/%s %d %s\r\n" % (version, status, REASONS.get(status, b"Unknown"))]
    lines += [b"%s: %s\r\n" % pair for pair in headers]
    lines.append(b"content-length: %d\r\n" % len(body))
    if not keep_alive:
        lines.append(b"connection: close\r\n")
    elif version == b"1.0":  # HTTP/1.0 closes unless told otherwise
        lines.append(b"connection: keep-alive\r\n")
    lines.append(b"\r\n")
    if not head:
        lines.append(body)
    return b"".join(lines)
