"""Raw HTTP/1.1 for the fuzz tests: request bytes no HTTP client would send (malformed request
lines and header fields, odd Content-Length and chunked framing, pipelined requests), and a
reader of the answers that come back on one connection.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass

from hypothesis import strategies as st

from tests.conftest import Service
from tests.http_fuzz_client import HEADER_LENGTH, Answer
from tests.http_fuzz_strategies import make_draft, valid_inputs

#: how long a connection may stay quiet before its case ends: a request whose framing asks
#: for more bytes than were sent waits for them (up to the server's request timeout).
QUIET_S = 0.5
#: seconds to wait for the answers to requests framed correctly.
ANSWER_S = 30.0

VALID_TARGETS = [
    b"/v2/health/ready",
    b"/v2",
    b"/v2/models/nobatch",
    b"/v2/models/nobatch/infer",
    b"/v2/models/named_args/infer",
    b"/v2/repository/index",
]
METHODS = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"get", b"PRI"])
TARGETS = st.sampled_from(
    [*VALID_TARGETS, b"*", b"http://h/v2", b"/v2/models/%ff/infer", b"/v2/x?a=%00", b"/v2/" * 300]
)
VERSIONS = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9", b"http/1.1"])
HEADER_NAMES = st.sampled_from(
    [
        b"Host",
        b"Content-Length",
        b"Transfer-Encoding",
        b"Content-Encoding",
        b"Accept-Encoding",
        b"Expect",
        b"Connection",
        HEADER_LENGTH.encode(),
        b"Content-Type",
        b"X-A",
    ]
)
HEADER_VALUES = st.sampled_from(
    [
        b"",
        b"0",
        b"-1",
        b"chunked",
        b"gzip",
        b"gzip, chunked",
        b"100-continue",
        b"close",
        b"\xff\xfe",
        b"g\xe9zip",
        b"9" * 30,
        b" 5 ",
        b"0x10",
    ]
)
#: a header line as sent: a field, a field with raw bytes, or a line that is no field at all.
HEADER_LINES = (
    st.tuples(HEADER_NAMES, HEADER_VALUES | st.binary(max_size=12)).map(lambda f: b": ".join(f))
    | st.sampled_from([b"NoColon", b"Space : x", b" folded", b":", b"X-A:\x00"])
    | st.binary(max_size=16)
)


def chunked(body: bytes, cuts: list[int], extension: bytes = b"", trailer: bytes = b"") -> bytes:
    """`body` in chunks ending at `cuts`, each size line with `extension`, then the last chunk
    and `trailer` (header lines)."""
    pieces, start = [], 0
    for cut in sorted({c for c in cuts if 0 < c < len(body)} | {len(body)}):
        if cut > start:
            pieces.append(b"%x%s\r\n%s\r\n" % (cut - start, extension, body[start:cut]))
            start = cut
    return b"".join(pieces) + b"0\r\n" + trailer + b"\r\n"


@dataclass
class Exchange:
    """Requests sent on one connection (pipelined), and what a correct server answers."""

    data: bytes
    #: the requests framed correctly before any that is not, each answered in order: their
    #: targets, and whether they are served (200) or only answered (their header fields are
    #: fuzzed).
    expected: list[tuple[bytes, bool]]
    #: every request is framed correctly: the last one's answer closes the connection.
    whole: bool


def valid_infer(model: str, binary: bool) -> tuple[bytes, list[bytes]]:
    """The body and extra header lines of a valid infer request to a quick model."""
    draft = make_draft(f"/v2/models/{model}", model, [binary] * len(valid_inputs(model)))
    body, headers = draft.encode(True)
    return body, [f"{name}: {value}".encode() for name, value in headers.items()]


@st.composite
def valid_requests(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A request any server must serve, framed one of the ways HTTP/1.1 allows; with the
    target it went to."""
    target = draw(st.sampled_from(VALID_TARGETS))
    lines: list[bytes] = [b"Host: x"]
    body = b""
    if target.endswith(b"/infer"):
        model = target.split(b"/")[3].decode()
        body, extra = valid_infer(model, draw(st.booleans()))
        lines += extra
    elif target == b"/v2/repository/index":
        body = b"{}"
    method = b"POST" if body else b"GET"
    if body and draw(st.booleans()):
        lines.append(b"Transfer-Encoding: chunked")
        cuts = draw(st.lists(st.integers(0, len(body)), max_size=6))
        extension = draw(st.sampled_from([b"", b";a=b", b";x", b';a="q"']))
        trailer = draw(st.sampled_from([b"", b"X-T: 1\r\n"]))
        framed = chunked(body, cuts, extension, trailer)
    else:
        lines.append(b"Content-Length: %d" % len(body))
        framed = body
    if body and draw(st.booleans()):
        lines.append(b"Expect: 100-continue")
    head = b"%s %s HTTP/1.1\r\n" % (method, target) + b"".join(line + b"\r\n" for line in lines)
    return head + b"\r\n" + framed, target


#: a header field value as llhttp accepts it (visible ASCII and obs-text), anything else.
FIELD_VALUES = st.lists(st.integers(0x21, 0xFF).filter(lambda b: b != 0x7F), max_size=12).map(bytes)


@st.composite
def header_length_requests(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A binary-tensor infer request, framed correctly, whose Inference-Header-Content-Length
    is anything: short of the JSON, past the body, not a number; with the target."""
    model = draw(st.sampled_from(["nobatch", "named_args"]))
    body, _ = valid_infer(model, True)
    value = draw(
        st.integers(-3, len(body) + 3).map(lambda n: b"%d" % n)
        | st.sampled_from([b"", b"9" * 30, b"+5", b"0x10", b"1e3", b"\xff\xfe"])
        | FIELD_VALUES
    )
    target = b"/v2/models/%s/infer" % model.encode()
    head = b"POST %s HTTP/1.1\r\nContent-Length: %d\r\n" % (target, len(body))
    return head + b"%s: %s\r\n\r\n" % (HEADER_LENGTH.encode(), value) + body, target


@st.composite
def mangled_requests(draw: st.DrawFn) -> bytes:
    """A request with its request line, header fields or framing broken one way or another."""
    method, target, version = draw(METHODS), draw(TARGETS), draw(VERSIONS)
    eol = draw(st.sampled_from([b"\r\n", b"\n"]))
    line = draw(
        st.just(b"%s %s %s" % (method, target, version))
        | st.sampled_from([b"GET", b"GET /v2", b"GET  /v2 HTTP/1.1", b"\x00", b""])
        | st.binary(max_size=24)
    )
    lines = draw(st.lists(HEADER_LINES, max_size=5))
    body = draw(st.binary(max_size=64) | st.sampled_from([valid_infer("nobatch", True)[0]]))
    framing = draw(st.sampled_from(["length", "length_off", "chunked", "bad_chunk", "none"]))
    if framing == "length":
        lines.append(b"Content-Length: %d" % len(body))
    elif framing == "length_off":
        lines.append(b"Content-Length: %d" % max(0, len(body) + draw(st.integers(-3, 3))))
    elif framing in ("chunked", "bad_chunk"):
        lines.append(b"Transfer-Encoding: chunked")
        cuts = draw(st.lists(st.integers(0, len(body)), max_size=4))
        body = chunked(body, cuts)
        if framing == "bad_chunk":
            at = draw(st.integers(0, len(body)))
            body = body[:at] + draw(st.sampled_from([b"zz\r\n", b"-1\r\n", b"\r\n", b"f" * 20]))
    head = line + eol + b"".join(line + eol for line in lines)
    return head + eol + body


@st.composite
def exchanges(draw: st.DrawFn) -> Exchange:
    """Up to three pipelined requests, some mangled; then one that asks to close."""
    parts: list[tuple[bytes, tuple[bytes, bool] | None]] = draw(
        st.lists(
            valid_requests().map(lambda r: (r[0], (r[1], True)))
            | header_length_requests().map(lambda r: (r[0], (r[1], False)))
            | mangled_requests().map(lambda m: (m, None)),
            min_size=1,
            max_size=3,
        )
    )
    last = b"GET /v2/health/live HTTP/1.1\r\nConnection: close\r\n\r\n"
    parts.append((last, (b"/v2/health/live", True)))
    expected: list[tuple[bytes, bool]] = []
    for _, framed in parts:
        if framed is None:
            break
        expected.append(framed)
    return Exchange(b"".join(part for part, _ in parts), expected, len(expected) == len(parts))


def _head(buffer: bytes) -> tuple[int, dict[str, str], bytes] | None:
    """The status and headers of the answer starting `buffer`, and what follows them."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    status_line, *lines = buffer[:end].split(b"\r\n")
    headers = {
        name.decode().lower(): value.decode()
        for name, value in (line.split(b": ", 1) for line in lines)
    }
    return int(status_line.split()[1]), headers, buffer[end + 4 :]


def _parse(buffer: bytes, closed: bool) -> tuple[Answer | None, bytes]:
    """The first whole answer in `buffer` (interim 1xx answers skipped), and what follows;
    once `closed`, an answer without a length (a stream) runs to the end."""
    while (head := _head(buffer)) is not None:
        status, headers, rest = head
        if 100 <= status < 200:
            buffer = rest
            continue
        if "content-length" not in headers:
            return (Answer(status, headers, rest), b"") if closed else (None, buffer)
        length = int(headers["content-length"])
        if len(rest) < length:
            return None, buffer
        return Answer(status, headers, rest[:length]), rest[length:]
    return None, buffer


def exchange(svc: Service, data: bytes, expected: int) -> tuple[list[Answer], bool]:
    """Send `data` on a connection of its own and read the answers until it closes, or until
    it has been quiet for QUIET_S once `expected` answers came; the answers, and whether the
    server closed."""
    host, port = svc.http_url.rsplit(":", 1)
    answers: list[Answer] = []
    buffer, closed = b"", False
    with socket.create_connection((host, int(port)), timeout=ANSWER_S) as conn:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused early
            conn.sendall(data)
        while True:
            conn.settimeout(ANSWER_S if len(answers) < expected else QUIET_S)
            answer, buffer = _parse(buffer, closed)
            if answer is not None:
                answers.append(answer)
                continue
            if closed:
                assert not buffer, f"an answer cut short: {buffer[:300]!r}"
                return answers, True
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                return answers, False
            except ConnectionResetError:
                chunk = b""
            closed = not chunk
            buffer += chunk
