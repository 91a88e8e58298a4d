"""The SDK's HTTP/1.1 transports: blocking (http.client) and asyncio, both keep-alive, over
plain HTTP or TLS (https://, with certificate and hostname checks)."""

from __future__ import annotations

import asyncio
import http.client
import ssl
from urllib.parse import urlsplit

Response = tuple[int, dict[str, str], bytes]

#: a URL's port when it names none: sluice's for http (and no scheme), the standard for https.
DEFAULT_PORTS = {"http": 8000, "https": 443}


def split_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a gateway URL; a bare `host[:port]` is http."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in DEFAULT_PORTS:
        raise ValueError(
            f"unsupported URL scheme '{parts.scheme}' in {url!r}: use http:// or https://"
        )
    return parts.scheme, parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORTS[parts.scheme]


def tls_context(
    scheme: str, ca_file: str | None, ssl_context: ssl.SSLContext | None
) -> ssl.SSLContext | None:
    """The TLS settings for an https URL: `ssl_context` as given, else the system's CAs (or
    only `ca_file`'s) with hostname checks; None for plain http."""
    if scheme == "http":
        if ca_file is not None or ssl_context is not None:
            raise ValueError("ca_file and ssl_context need an https:// URL")
        return None
    return ssl_context or ssl.create_default_context(cafile=ca_file)


class Endpoint:
    """Where a transport connects, and how (TLS settings for https)."""

    def __init__(self, url: str, ca_file: str | None, ssl_context: ssl.SSLContext | None) -> None:
        scheme, self.host, self.port = split_url(url)
        self.tls = tls_context(scheme, ca_file, ssl_context)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = f"{host}:{self.port}"


class SyncTransport:
    def __init__(self, endpoint: Endpoint, timeout_s: float, headers: dict[str, str]) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.headers = headers
        self._conn: http.client.HTTPConnection | None = None

    def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Response:
        for attempt in (1, 2):  # a kept-alive connection the server closed is reopened once
            if self._conn is None:
                self._conn = self._connect()
            self._conn.timeout = timeout_s or self.timeout_s
            try:
                self._conn.request(
                    method, path, body=body or None, headers={**self.headers, **(headers or {})}
                )
                response = self._conn.getresponse()
                data = response.read()
            except (ConnectionError, http.client.HTTPException):
                self.close()
                if attempt == 2:
                    raise
                continue
            return response.status, {k.lower(): v for k, v in response.getheaders()}, data
        raise AssertionError("unreachable")

    def _connect(self) -> http.client.HTTPConnection:
        where = self.endpoint
        if where.tls is None:
            return http.client.HTTPConnection(where.host, where.port, self.timeout_s)
        return http.client.HTTPSConnection(
            where.host, where.port, timeout=self.timeout_s, context=where.tls
        )

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class AsyncTransport:
    """One connection per request in flight, kept for reuse: concurrent calls are fine."""

    def __init__(self, endpoint: Endpoint, timeout_s: float, headers: dict[str, str]) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.headers = headers
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Response:
        async with asyncio.timeout(timeout_s or self.timeout_s):
            for attempt in (1, 2):
                reused = bool(self._idle)
                reader, writer = self._idle.pop() if reused else await self._open()
                try:
                    response = await self._exchange(reader, writer, method, path, body, headers)
                except (ConnectionError, asyncio.IncompleteReadError):
                    writer.close()
                    if reused and attempt == 1:
                        continue  # the server closed an idle connection: open a fresh one
                    raise
                except BaseException:
                    writer.close()
                    raise
                if response[1].get("connection", "").lower() == "close":
                    writer.close()
                else:
                    self._idle.append((reader, writer))
                return response
        raise AssertionError("unreachable")

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, tls = self.endpoint.host, self.endpoint.tls
        reader, writer = await asyncio.open_connection(host, self.endpoint.port)
        if tls is None:
            return reader, writer
        # the handshake on a connection of our own, so that a failed one can be closed for
        # sure: the socket must not outlive the caller's event loop (a ResourceWarning)
        try:
            await writer.start_tls(tls, server_hostname=host)
        except BaseException:
            await _abort(writer.transport)
            raise
        return reader, writer

    async def _exchange(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        method: str,
        path: str,
        body: bytes,
        headers: dict[str, str] | None,
    ) -> Response:
        all_headers = {
            **self.headers,
            **(headers or {}),
            "Host": self.endpoint.host_header,
            "Content-Length": str(len(body)),
        }
        head = (
            f"{method} {path} HTTP/1.1\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in all_headers.items())
            + "\r\n"
        )
        writer.write(head.encode() + body)
        await writer.drain()
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("server closed the connection")
        status = int(status_line.split()[1])
        response_headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            response_headers[name.strip().lower()] = value.strip()
        if "content-length" in response_headers:
            data = await reader.readexactly(int(response_headers["content-length"]))
        else:
            data = await reader.read()
            response_headers["connection"] = "close"
        return status, response_headers, data

    async def close(self) -> None:
        """Close the idle connections now, without a TLS shutdown (which waits on the peer), so
        that no socket outlives the caller's event loop."""
        idle, self._idle = self._idle, []
        await _abort(*(writer.transport for _, writer in idle))


async def _abort(*transports: asyncio.WriteTransport) -> None:
    """Close `transports` at once, dropping what they still hold to write (after a failed
    handshake, a TLS alert that a peer may never read: a plain close would wait for it), and
    return once their sockets are closed. Each closes its socket from a callback it schedules as
    it aborts, which the loop runs before it resumes this coroutine."""
    for transport in transports:
        transport.abort()
    await asyncio.sleep(0)
