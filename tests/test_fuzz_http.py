"""Fuzzing the HTTP API of a live `sluice serve` with hypothesis, over plain http.client and
over raw sockets (framing no client would send).

Whatever arrives, the server must answer: never a 5xx other than 503, every non-2xx with a
JSON body holding a string "error", no hang; afterwards it must still serve valid requests
correctly, with the same workers, and its memory must not have grown with what it was sent.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.conftest import Service
from tests.http_fuzz_client import (
    HEADER_LENGTH,
    assert_still_serving,
    call,
    check,
    fire,
    infer_json,
    tensor_json,
)
from tests.http_fuzz_raw import Exchange, exchange, exchanges
from tests.http_fuzz_strategies import (
    INFER_LIKE,
    JSON_VALUES,
    METHODS,
    MODEL_NAMES,
    MODELS,
    PRINTABLE,
    QUICK_MODELS,
    dump,
    make_draft,
    near_valid,
    path_segments,
    valid_inputs,
)
from tests.process_tree import alive, descendants, rss_mb

#: SLUICE_FUZZ_EXAMPLES=2000 for a longer hunt; the default keeps the file under a minute.
FUZZ = settings(
    max_examples=int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


#: what the gateway's RSS may grow by over the module: code paths warmed, caches filled.
RSS_GROWTH_MB = 32


@dataclass
class Baseline:
    rss_mb: float
    processes: set[int]


@pytest.fixture(scope="module", autouse=True)
def baseline(service: Service) -> Iterator[Baseline]:
    """The serve process's memory and its processes (workers) before the fuzz."""
    yield Baseline(rss_mb(service.process.pid), descendants(service.process.pid))


# ----------------------------------------------------------------------------- tests


def test_base_requests_are_valid(service: Service) -> None:
    """The unmutated drafts are valid requests, so the mutations start from something real."""
    for model in QUICK_MODELS:
        for binary in (False, True):
            draft = make_draft(f"/v2/models/{model}", model, [binary] * len(valid_inputs(model)))
            body, headers = draft.encode(True)
            answer = call(service, "POST", draft.path, body, headers)
            assert answer.status == 200, (model, binary, answer.body[:300])


@FUZZ
@given(model=MODEL_NAMES, value=JSON_VALUES | INFER_LIKE, ascii_only=st.booleans())
def test_random_json_bodies(service: Service, model: str, value: Any, ascii_only: bool) -> None:
    body = dump(value, ascii_only)
    fire(service, "POST", f"/v2/models/{quote(model, safe='')}/infer", body)


@FUZZ
@given(case=near_valid())
def test_near_valid_infer_bodies(service: Service, case: tuple[str, bytes, dict, list]) -> None:
    path, body, headers, mutations = case
    answer = fire(service, "POST", path, body, headers)
    event(f"HTTP {answer.status} after {'+'.join(sorted(mutations))}")


@FUZZ
@given(
    model=st.sampled_from([*QUICK_MODELS, "batch8", "broken", "missing"]),
    head=INFER_LIKE.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=64),
    tail=st.binary(max_size=64),
    length=st.integers(-5, 140).map(str)
    | PRINTABLE
    | st.integers(-(2**80), 2**80).map(str)
    | st.just("9" * 5000),
)
def test_header_length_values(
    service: Service, model: str, head: bytes, tail: bytes, length: str
) -> None:
    fire(
        service,
        "POST",
        f"/v2/models/{model}/infer",
        head + tail,
        {HEADER_LENGTH: length, "Content-Type": "application/octet-stream"},
    )


@FUZZ
@given(
    model=MODEL_NAMES,
    body=st.binary(max_size=256),
    encoding=st.none()
    | st.sampled_from(["gzip", "deflate", "identity", "br", "GZIP", "", "g\xe9zip", "\xff"]),
    compress=st.booleans(),
    accept=st.none() | st.sampled_from(["gzip", "deflate", "br", "*"]),
    chunked=st.booleans(),
)
def test_random_bytes(
    service: Service,
    model: str,
    body: bytes,
    encoding: str | None,
    compress: bool,
    accept: str | None,
    chunked: bool,
) -> None:
    headers: dict[str, str] = {}
    if encoding is not None:
        headers["Content-Encoding"] = encoding
        if compress and encoding == "gzip":
            body = gzip.compress(body)
        elif compress and encoding == "deflate":
            body = zlib.compress(body)
    if accept is not None:
        headers["Accept-Encoding"] = accept
    path = f"/v2/models/{quote(model, safe='')}/infer"
    fire(service, "POST", path, body, headers, chunked=chunked and bool(body))


@FUZZ
@given(
    method=st.sampled_from(METHODS),
    prefix=st.sampled_from([[], ["models"], ["health"], ["repository"]])
    | MODEL_NAMES.map(lambda m: ["models", quote(m, safe="")])
    | st.tuples(st.sampled_from(MODELS), path_segments()).map(
        lambda mv: ["models", mv[0], "versions", mv[1]]
    ),
    segments=st.lists(path_segments(), max_size=4),
    query=st.none() | PRINTABLE.map(lambda t: quote(t, safe="=&")),
    body=st.none() | st.binary(max_size=64) | JSON_VALUES.map(lambda v: json.dumps(v).encode()),
)
def test_random_paths_and_methods(
    service: Service,
    method: str,
    prefix: list[str],
    segments: list[str],
    query: str | None,
    body: bytes | None,
) -> None:
    segments = prefix + segments
    path = "/v2/" + "/".join(segments)
    if query is not None:
        path += "?" + query
    answer = fire(service, method, path, body if method != "HEAD" else None)
    event(f"HTTP {answer.status}")


@FUZZ
@given(case=exchanges())
def test_raw_framing_and_pipelining(service: Service, case: Exchange) -> None:
    answers, closed = exchange(service, case.data, len(case.expected))
    what = f"raw {case.data[:600]!r}"
    for answer in answers:
        check(answer, "POST", what)
    # the requests framed correctly before any that is not are answered, in order
    assert len(answers) >= len(case.expected), (what, answers)
    for (target, served), answer in zip(case.expected, answers, strict=False):
        if served:
            assert answer.status == 200, (what, target, answer)
        if answer.status == 200 and target.endswith(b"/infer"):
            assert b'"outputs"' in answer.body, (what, answer)
    if case.whole:
        assert closed and len(answers) == len(case.expected), (what, answers)
    event(f"{len(case.expected)} framed correctly, {len(answers)} answers")


def _nest(depth: int) -> str:
    return "[" * depth + "1.0" + "]" * depth


def _nested_body(depth: int) -> bytes:
    head = '{"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2, 3], "data": '
    return (head + _nest(depth) + "}]}").encode()


def test_json_nested_past_the_parser_depth_limit(service: Service) -> None:
    answer = fire(service, "POST", "/v2/models/nobatch/infer", _nested_body(2000))
    assert answer.status == 400


def test_empty_variable_dim(service: Service) -> None:
    body = json.dumps({"inputs": [tensor_json("IN", "INT32", [1, 0], [])]}).encode()
    answer = fire(service, "POST", "/v2/models/varlen/infer", body)
    if answer.status == 200:
        assert json.loads(answer.body)["outputs"][0]["data"] == [0]


# ------------------------------------------------------------------- past bugs


@pytest.mark.parametrize(
    ("version", "status"),
    [("%C2%B2", 404), ("9" * 5000, 400)],  # Triton's routes take ASCII digits alone
    ids=["superscript-two", "5000-digits"],
)
@pytest.mark.parametrize("action", ["ready", "infer"])
def test_version_that_is_digits_but_no_int(
    service: Service, version: str, status: int, action: str
) -> None:
    method = "POST" if action == "infer" else "GET"
    path = f"/v2/models/versioned/versions/{version}/{action}"
    answer = fire(service, method, path, b"{}" if method == "POST" else None)
    assert answer.status == status


def test_json_data_nested_just_within_the_parser_depth_limit(service: Service) -> None:
    answer = fire(service, "POST", "/v2/models/nobatch/infer", _nested_body(1000))
    assert answer.status == 400


def test_a_content_encoding_that_is_not_utf_8_is_a_400(service: Service) -> None:
    headers = {"Content-Encoding": "g\xe9zip"}  # http.client sends it as latin-1: not UTF-8
    answer = fire(service, "POST", "/v2/models/nobatch/infer", b"{}", headers)
    assert answer.status == 400 and b"Content-Encoding" in answer.body


def test_still_serving_after_the_fuzz(service: Service, baseline: Baseline) -> None:
    assert_still_serving(service)
    pid = service.process.pid
    assert all(alive(process) for process in baseline.processes), "a worker died"
    assert rss_mb(pid) - baseline.rss_mb <= RSS_GROWTH_MB, (baseline.rss_mb, rss_mb(pid))
    # batch8 waits up to 1 s for a batch: one request only
    out = infer_json(service, "batch8", [tensor_json("IN", "FP32", [1, 4], [1.0, -2.0, 0.5, 8.0])])
    assert out["OUT"]["shape"] == [1, 4]
    assert out["OUT"]["data"] == [2.0, -4.0, 1.0, 16.0]
