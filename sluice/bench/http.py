"""A minimal keep-alive HTTP/1.1 client: exactly what a KServe v2 server answers, no more.

It reads the status line, the headers and a Content-Length body, so that the load generator
spends its CPU on sending load rather than on a general-purpose HTTP stack.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any

import orjson

HEAD_END = b"\r\n\r\n"


class ProtocolError(Exception):
    """The server answered something this client does not parse."""


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    content_length: int
    keep_alive: bool


def parse_head(head: bytes) -> ResponseHead:
    """Parse a response's status line and headers (up to and including the blank line)."""
    if not head.startswith(b"HTTP/1.") or len(head) < 12 or not head[9:12].isdigit():
        raise ProtocolError(f"not an HTTP/1.x status line: {head[:40]!r}")
    lower = head.lower()
    start = lower.find(b"\r\ncontent-length:")
    if start < 0:
        raise ProtocolError("response has no Content-Length (chunked bodies are not supported)")
    start += len(b"\r\ncontent-length:")
    end = lower.find(b"\r\n", start)
    try:
        length = int(lower[start:end])
    except ValueError:
        raise ProtocolError("malformed Content-Length") from None
    keep_alive = head[7:8] == b"1" and b"\r\nconnection: close" not in lower
    return ResponseHead(int(head[9:12]), length, keep_alive)


def encode_get(authority: str, path: str, auth_token: str | None = None) -> bytes:
    return encode_request("GET", authority, path, b"", {}, auth_token)


def encode_request(
    method: str,
    authority: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    auth_token: str | None = None,
) -> bytes:
    """The whole request as bytes, so a hot loop only has to write it."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {authority}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if auth_token:
        lines.append(f"Authorization: Bearer {auth_token}")
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Connection:
    """One keep-alive connection; requests on it go one after the other."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> Connection:
        self.close()
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        sock = self._writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    @property
    def closed(self) -> bool:
        """Not open, or the server closed its side (an idle keep-alive timed out)."""
        return (
            self._reader is None
            or self._writer is None
            or self._writer.is_closing()
            or self._reader.at_eof()
        )

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        """Send one request and return (status, body); closes when the server says so."""
        if self._reader is None or self._writer is None:
            raise ProtocolError("connection is not open")
        self._writer.write(request)
        head = parse_head(await self._reader.readuntil(HEAD_END))
        body = await self._reader.readexactly(head.content_length) if head.content_length else b""
        if not head.keep_alive:
            self.close()
        return head.status, body

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


async def get_json(conn: Connection, request: bytes) -> tuple[int, Any]:
    """A GET whose answer is JSON (metadata, config, statistics)."""
    status, body = await conn.exchange(request)
    try:
        return status, orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        raise ProtocolError(f"HTTP {status}: body is not JSON: {body[:80]!r}") from None
