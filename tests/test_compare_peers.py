"""The peer comparison's own parts, against a small HTTP server in this process.

The load generator must read the bodies every peer sends (Content-Length, and chunked as Ray
Serve's proxy answers), count what one window answered, and charge CPU to the right process
tree; the listening check must see where a server's sockets are; the ratios must compare
sluice with the best peer.
"""

from __future__ import annotations

import os
import socketserver
import sys
import threading
from collections.abc import Iterator
from ipaddress import ip_address
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "benchmarks")]
from peer_load import CLOCK_TICKS, Load, Point, closed_loop, exchange, merged  # noqa: E402
from peer_report import ratios  # noqa: E402
from peer_servers import listening  # noqa: E402

from sluice.bench.http import encode_request  # noqa: E402

BODY = b"[[0.5, 1.5]]"


class _Handler(socketserver.StreamRequestHandler):
    """Answers each request on a keep-alive connection; /chunked in two chunks."""

    def handle(self) -> None:
        while head := self._head():
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            self.rfile.read(length)
            if head[0].split()[1] == b"/chunked":
                half = len(BODY) // 2
                chunks = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (BODY[:half], BODY[half:]))
                self.wfile.write(
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
                )
            else:
                self.wfile.write(
                    b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
                )
            self.wfile.flush()

    def _head(self) -> list[bytes]:
        lines = []
        while (line := self.rfile.readline()) not in (b"\r\n", b""):
            lines.append(line.rstrip())
        return lines


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    socketserver.ThreadingTCPServer.daemon_threads = True
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Handler) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        yield "127.0.0.1", httpd.server_address[1]
        httpd.shutdown()


def _request(address: tuple[str, int], path: str) -> bytes:
    authority = f"{address[0]}:{address[1]}"
    return encode_request("POST", authority, path, b'{"data": [[1]]}', {})


@pytest.mark.parametrize("path", ["/fixed", "/chunked"])
def test_a_body_is_read_by_its_length_or_its_chunks(server: tuple[str, int], path: str) -> None:
    assert exchange(server, _request(server, path)) == (200, BODY)


def test_one_window_counts_the_answers_and_the_cpu(server: tuple[str, int]) -> None:
    load = Load(server, _request(server, "/chunked"), 4, 0.05, 0.3, os.getpid())
    point = closed_loop(load)
    assert point.errors == {}
    assert point.answered == len(point.latencies_s) > 0
    assert point.throughput > 0
    assert 0 < point.percentile_ms(0.5) <= point.percentile_ms(0.99)
    # the server runs in this process: its tree's CPU includes the load generator's, read a
    # moment apart at each end of the window, so the two may differ by one clock tick
    assert point.server_cpu_s >= point.loadgen_cpu_s - 1 / CLOCK_TICKS - 1e-9
    assert point.loadgen_cpu_s > 0
    assert 0 <= point.machine_busy <= 1


def test_turns_merge_into_one_point() -> None:
    first = Point(1.0, 2, {"HTTP 503": 1}, [0.001, 0.003], 0.5, 0.1, 0.5)
    second = Point(3.0, 2, {"HTTP 503": 2}, [0.002, 0.004], 1.5, 0.3, 1.0)
    point = merged([first, second])
    assert point.throughput == 1.0  # 4 answers in 4 s
    assert point.errors == {"HTTP 503": 3}
    assert sorted(point.latencies_s) == [0.001, 0.002, 0.003, 0.004]
    assert point.cpu_ms_per_request(point.server_cpu_s) == 500.0
    assert point.machine_busy == 0.875  # weighted by each turn's length


def test_where_a_process_tree_listens(server: tuple[str, int]) -> None:
    found = listening(os.getpid())
    assert (ip_address("127.0.0.1"), server[1]) in found
    assert all(ip.is_loopback for ip, _ in found)


def _row(peer: str, protocol: str, c: int, throughput: float, p50: float, p99: float) -> dict:
    return {
        "peer": peer,
        "protocol": protocol,
        "concurrency": c,
        "throughput": throughput,
        "p50_ms": p50,
        "p99_ms": p99,
    }


def test_sluice_is_compared_with_the_best_peer() -> None:
    rows = [
        _row("sluice", "json", 64, 3000, 20, 40),
        _row("pytriton", "binary", 64, 2000, 30, 50),
        _row("ray", "json", 64, 200, 300, 500),
        _row("sluice", "json", 1, 250, 4.0, 8),
        _row("bentoml", "json", 1, 240, 5.0, 9),
        _row("ray", "json", 1, 90, 10.0, 18),
    ]
    lines = ratios(rows, [1, 64])
    assert lines == [
        "- c=64, sluice json / best peer (pytriton binary): throughput 1.50x (3,000 vs 2,000/s), "
        "p99 0.80x (40.0 vs 50.0 ms; below 1 is better)",
        "- c=1, sluice json p50 4.00 ms vs the lowest peer's (bentoml json) 5.00 ms: 0.80x",
    ]
