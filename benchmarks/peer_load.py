"""One closed-loop HTTP load, the same for every server, with the CPU each side spent from /proc.

`concurrency` keep-alive connections each send the next request when the last is answered: a
raw HTTP/1.1 client (request bytes built once, only the status line, the headers and the body
read: by Content-Length, or chunked as Ray Serve's proxy answers), so that the client's cost is
small and the same for every server. After a warm-up, one window is measured: requests
answered in it, their latencies, and the CPU time of the server's process tree and of this
process, read from /proc at the window's two ends, so CPU per request compares servers built
of any number of processes (Ray's raylet and workers, Triton and its Python stub, sluice's
gateway, worker and Redis).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import uvloop

from tests.process_tree import descendants

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
HEAD_END = b"\r\n\r\n"
#: a client whose connection failed waits this long before it connects again.
RECONNECT_PAUSE_S = 0.05


class ProtocolError(Exception):
    """An answer this client does not parse."""


ERRORS = (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ProtocolError)


def _header(head: bytes, name: bytes) -> bytes | None:
    """A header's value in a lower-cased response head."""
    start = head.find(b"\r\n" + name + b":")
    if start < 0:
        return None
    start += len(name) + 3
    return head[start : head.find(b"\r\n", start)].strip()


class Connection:
    """One keep-alive connection; its requests go one after the other."""

    def __init__(self, host: str, port: int) -> None:
        self.address = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> Connection:
        self.close()
        self.reader, self.writer = await asyncio.open_connection(*self.address)
        self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    @property
    def closed(self) -> bool:
        return self.writer is None or self.writer.is_closing()

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        """Send one request, return (status, body)."""
        if self.reader is None or self.writer is None:
            raise ProtocolError("connection is not open")
        self.writer.write(request)
        head = (await self.reader.readuntil(HEAD_END)).lower()
        if not head.startswith(b"http/1.") or not head[9:12].isdigit():
            raise ProtocolError(f"not an HTTP/1.x status line: {head[:40]!r}")
        length = _header(head, b"content-length")
        if length is not None:
            body = await self.reader.readexactly(int(length))
        elif _header(head, b"transfer-encoding") == b"chunked":
            body = await self._chunks()
        else:
            raise ProtocolError("neither Content-Length nor chunked")
        if _header(head, b"connection") == b"close":
            self.close()
        return int(head[9:12]), body

    async def _chunks(self) -> bytes:
        assert self.reader is not None
        parts = []
        while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
            parts.append((await self.reader.readexactly(size + 2))[:-2])
        await self.reader.readuntil(b"\r\n")  # the blank line after the last chunk
        return b"".join(parts)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def process_cpu_s(pid: int) -> float:
    """utime + stime of one process (all its threads), 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root` and every process below it, as they are now."""
    return sum(process_cpu_s(pid) for pid in {root, *descendants(root)})


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


@dataclass(slots=True)
class Window:
    recording: bool = False
    latencies_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class Point:
    duration_s: float
    answered: int
    errors: dict[str, int]
    latencies_s: list[float]
    server_cpu_s: float
    loadgen_cpu_s: float
    machine_busy: float  # share of all cores busy during the window

    @property
    def throughput(self) -> float:
        return self.answered / self.duration_s

    def percentile_ms(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 if ordered else 0.0

    def cpu_ms_per_request(self, cpu_s: float) -> float:
        return cpu_s * 1e3 / max(1, self.answered)


def merged(points: list[Point]) -> Point:
    """Several windows of one load as one: counts and CPU added, latencies pooled."""
    errors: Counter[str] = Counter()
    for point in points:
        errors.update(point.errors)
    duration_s = sum(p.duration_s for p in points)
    return Point(
        duration_s=duration_s,
        answered=sum(p.answered for p in points),
        errors=dict(errors),
        latencies_s=[latency for p in points for latency in p.latencies_s],
        server_cpu_s=sum(p.server_cpu_s for p in points),
        loadgen_cpu_s=sum(p.loadgen_cpu_s for p in points),
        machine_busy=sum(p.machine_busy * p.duration_s for p in points) / max(duration_s, 1e-9),
    )


async def _client(conn: Connection, request: bytes, window: Window, running: list[bool]) -> None:
    while running:
        try:
            if conn.closed:
                await conn.open()
            start_s = time.perf_counter()
            status, body = await conn.exchange(request)
        except ERRORS as exc:
            conn.close()
            if window.recording:
                window.errors[f"connection: {type(exc).__name__}"] += 1
            await asyncio.sleep(RECONNECT_PAUSE_S)  # no busy loop on a server that went away
            continue
        if window.recording:
            if status == 200:
                window.latencies_s.append(time.perf_counter() - start_s)
            else:
                window.errors[f"HTTP {status}: {body[:80]!r}"] += 1
    conn.close()


@dataclass(frozen=True, slots=True)
class Load:
    address: tuple[str, int]
    request: bytes  # the whole HTTP request, sent as is
    concurrency: int
    warmup_s: float
    measure_s: float
    server_pid: int  # the root of the server's process tree


async def _closed_loop(load: Load) -> Point:
    conns = [await Connection(*load.address).open() for _ in range(load.concurrency)]
    window, running = Window(), [True]
    tasks = [asyncio.create_task(_client(c, load.request, window, running)) for c in conns]
    await asyncio.sleep(load.warmup_s)
    server_cpu_s, own_cpu_s = tree_cpu_s(load.server_pid), process_cpu_s(os.getpid())
    busy = machine_busy()
    start_s = time.perf_counter()
    window.recording = True
    await asyncio.sleep(load.measure_s)
    window.recording = False
    elapsed_s = time.perf_counter() - start_s
    server_cpu_end_s, own_cpu_end_s = tree_cpu_s(load.server_pid), process_cpu_s(os.getpid())
    busy_end = machine_busy()
    running.clear()
    await asyncio.gather(*tasks)
    return Point(
        duration_s=elapsed_s,
        answered=len(window.latencies_s),
        errors=dict(window.errors),
        latencies_s=window.latencies_s,
        server_cpu_s=server_cpu_end_s - server_cpu_s,
        loadgen_cpu_s=own_cpu_end_s - own_cpu_s,
        machine_busy=(busy_end[0] - busy[0]) / max(1, busy_end[1] - busy[1]),
    )


def closed_loop(load: Load) -> Point:
    """Warm up, then measure one window (on uvloop, the cheaper client)."""
    return uvloop.run(_closed_loop(load))


async def _exchange(address: tuple[str, int], request: bytes) -> tuple[int, bytes]:
    conn = await Connection(*address).open()
    try:
        return await conn.exchange(request)
    finally:
        conn.close()


def exchange(address: tuple[str, int], request: bytes) -> tuple[int, bytes]:
    """One request on a fresh connection: (status, body)."""
    return asyncio.run(_exchange(address, request))
