"""The gateway's HTTP details over raw sockets: HEAD, 413, and no `100 Continue` for a request
that will be refused (wrong token, unknown path, body over --max-body-bytes)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.conftest import Service, start_sluice, stop_service

TOKEN = "s3cret"
AUTH = b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"


@pytest.fixture(scope="module")
def gateway(service: Service) -> Iterator[Service]:
    """A gateway of its own (a token, a small body limit) beside the session's serve, whose
    workers make it ready."""
    args = ["--redis-url", service.redis_url, "--auth-token", TOKEN, "--max-body-bytes", "1000"]
    gateway = start_sluice("gateway", args)
    yield gateway
    stop_service(gateway)


def _connect(gateway: Service) -> socket.socket:
    host, port = gateway.http_url.split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _read_response(
    conn: socket.socket, head_only: bool = False
) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """Status line, headers, and the body the content-length announces (none after a HEAD)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *lines = head.split(b"\r\n")
    headers = {k.lower(): v for k, v in (line.split(b": ", 1) for line in lines)}
    length = 0 if head_only else int(headers.get(b"content-length", b"0"))
    while len(rest) < length:
        rest += conn.recv(65536)
    return status_line, headers, rest[:length]


def _closed(conn: socket.socket) -> bool:
    return conn.recv(1) == b""


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: 10\r\n", b"401"),
        (b"POST /nope HTTP/1.1\r\nContent-Length: 10\r\n" + AUTH, b"404"),
        (b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: 1001\r\n" + AUTH, b"413"),
    ],
    ids=["no token", "unknown path", "body over the limit"],
)
def test_a_request_that_will_be_refused_gets_no_100_continue(
    gateway: Service, head: bytes, status: bytes
) -> None:
    with _connect(gateway) as conn:
        conn.sendall(head + b"Expect: 100-continue\r\n\r\n")
        status_line, _, _ = _read_response(conn)  # the refusal at once, before any body
        assert status_line.split()[1] == status
        assert _closed(conn)


def test_a_request_that_will_be_served_gets_100_continue(gateway: Service) -> None:
    with _connect(gateway) as conn:
        conn.sendall(
            b"POST /v2/repository/index HTTP/1.1\r\nContent-Length: 2\r\n"
            + AUTH
            + b"Expect: 100-continue\r\n\r\n"
        )
        assert conn.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        conn.sendall(b"{}")
        status_line, _, body = _read_response(conn)
        assert status_line == b"HTTP/1.1 200 OK" and b"nobatch" in body


def test_a_body_over_the_limit_is_a_413_and_the_connection_is_kept(gateway: Service) -> None:
    with _connect(gateway) as conn:
        conn.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: 1001\r\n" + AUTH)
        conn.sendall(b"\r\n" + b"x" * 1001)
        status_line, _, body = _read_response(conn)
        assert status_line.split()[1] == b"413"
        assert b"exceeds the limit of 1000 bytes" in body
        conn.sendall(b"GET /v2/health/live HTTP/1.1\r\n\r\n")
        assert _read_response(conn)[0] == b"HTTP/1.1 200 OK"


def test_head_is_a_get_without_the_body(gateway: Service) -> None:
    with _connect(gateway) as conn:
        conn.sendall(b"GET /v2 HTTP/1.1\r\n" + AUTH + b"\r\n")
        _, get_headers, body = _read_response(conn)
        conn.sendall(b"HEAD /v2 HTTP/1.1\r\n" + AUTH + b"\r\n")
        status_line, headers, _ = _read_response(conn, head_only=True)
        assert status_line == b"HTTP/1.1 200 OK"
        assert headers[b"content-length"] == get_headers[b"content-length"] == b"%d" % len(body)
        conn.sendall(b"GET /v2/health/live HTTP/1.1\r\n\r\n")  # nothing came between
        assert _read_response(conn)[0] == b"HTTP/1.1 200 OK"


def test_the_metrics_port_is_open_by_default_as_tritons_is(gateway: Service) -> None:
    """--auth-token guards the API, not the metrics port Prometheus scrapes (unless
    --metrics-auth-token is given: tests/test_restricted_apis.py)."""
    host, port = gateway.metrics_url.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        status_line, _, body = _read_response(conn)
        assert status_line == b"HTTP/1.1 200 OK" and b"nv_inference_count" in body
