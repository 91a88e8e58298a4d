"""Health probes for an orchestrator: a worker has no HTTP API, so it answers just these two.

GET /v2/health/live is 200 while the process runs; GET /v2/health/ready is 200 once its models
are loaded and its last heartbeat reached Redis, else 503.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

READ_TIMEOUT_S = 5.0
REASONS = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}


def _status(path: bytes, ready: Callable[[], bool]) -> int:
    if path == b"/v2/health/live":
        return 200
    if path == b"/v2/health/ready":
        return 200 if ready() else 503
    return 404


async def serve_health(host: str, port: int, ready: Callable[[], bool]) -> asyncio.Server:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)
            while (await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S)).strip():
                pass  # headers: nothing in them matters here
            parts = request_line.split()
            status = _status(parts[1].split(b"?")[0], ready) if len(parts) >= 2 else 404
            writer.write(
                f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-length: 0\r\n"
                "connection: close\r\n\r\n".encode()
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(answer, host, port)
