"""Large request bodies are freed once answered, whatever the answer, on both HTTP ports: a
client that sends big bodies and closes must not grow the gateway's memory."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import pytest

from tests.conftest import Service, start_sluice, stop_service, wait_until
from tests.process_tree import rss_mb

TOKEN = "s3cret"
AUTH = b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
BODY_BYTES = 50 << 20
BODIES = 5
#: what the gateway may keep of 5 x 50 MB once answered (allocator arenas, caches).
SLACK_MB = 30


@pytest.fixture(scope="module")
def gateway(service: Service) -> Iterator[Service]:
    """A gateway of its own (a token), so that its memory is this module's alone."""
    limit = str(BODY_BYTES + (1 << 20))
    gateway = start_sluice(
        "gateway",
        ["--redis-url", service.redis_url, "--auth-token", TOKEN, "--max-body-bytes", limit],
    )
    yield gateway
    stop_service(gateway)


def connect(address: str) -> socket.socket:
    host, port = address.split(":")
    return socket.create_connection((host, int(port)), timeout=60)


def post(conn: socket.socket, path: bytes, body: bytes, extra: bytes = b"") -> bytes:
    """POST `body` on `conn` (kept alive) and read the answer's head; its status code."""
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % (path, len(body))
    conn.sendall(head + extra + b"\r\n")
    conn.sendall(body)
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = conn.recv(65536)
        assert chunk, f"closed before an answer: {answer!r}"
        answer += chunk
    return answer.split()[1]


def assert_rss_comes_back(pid: int, before: float) -> None:
    wait_until(
        lambda: rss_mb(pid) - before <= SLACK_MB,
        f"the gateway's RSS to come back within {SLACK_MB} MB of {before:.0f} MB "
        f"after {BODIES} x {BODY_BYTES >> 20} MB bodies",
        timeout_s=30,  # a loaded machine returns freed memory late
    )


def large_body() -> bytes:
    return b"{" + b" " * (BODY_BYTES - 2) + b"}"


@pytest.mark.parametrize(
    ("port", "path", "extra", "status"),
    [
        ("http", b"/v2/models/nobatch/infer", b"", b"401"),
        ("http", b"/v2/models/nobatch/infer", AUTH, b"400"),
        ("metrics", b"/metrics", b"", b"200"),
    ],
    ids=["refused-401", "served-400", "metrics-port"],
)
def test_large_bodies_are_freed_once_their_connection_closes(
    gateway: Service, port: str, path: bytes, extra: bytes, status: bytes
) -> None:
    address = gateway.http_url if port == "http" else gateway.metrics_url
    pid = gateway.process.pid
    with connect(address) as conn:  # warm: the path's code has run once
        assert post(conn, path, b"{}", extra) == status
    before = rss_mb(pid)
    body = large_body()
    for _ in range(BODIES):
        with connect(address) as conn:
            assert post(conn, path, body, extra) == status
    assert_rss_comes_back(pid, before)


def test_kept_alive_connections_hold_no_body_once_answered(gateway: Service) -> None:
    pid = gateway.process.pid
    with connect(gateway.http_url) as conn:
        assert post(conn, b"/v2/models/nobatch/infer", b"{}", AUTH) == b"400"
    before = rss_mb(pid)
    body = large_body()
    with contextlib.ExitStack() as stack:
        for _ in range(BODIES):  # each connection stays open, idle, after its answer
            conn = stack.enter_context(connect(gateway.http_url))
            assert post(conn, b"/v2/models/nobatch/infer", body, AUTH) == b"400"
        assert_rss_comes_back(pid, before)
