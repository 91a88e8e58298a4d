"""Fuzzing the HTTP API of a live `sluice serve` with hypothesis, over plain http.client.

Whatever arrives, the server must answer: never a 5xx other than 503, every non-2xx with a
JSON body holding a string "error", no hang, and afterwards it must still serve valid
requests correctly.
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import string
import zlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, quote_from_bytes

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.conftest import Service

#: seconds any one request may take; nothing here should come close.
REQUEST_TIMEOUT_S = 30.0
HEADER_LENGTH = "Inference-Header-Content-Length"

#: SLUICE_FUZZ_EXAMPLES=2000 for a longer hunt; the default keeps the file under a minute.
FUZZ = settings(
    max_examples=int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "BF16",
    "FP32",
    "FP64",
    "BYTES",
]
NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "BF16": np.uint16,
    "FP32": np.float32,
    "FP64": np.float64,
}
#: every model of tests/model_repo, and some that do not exist.
MODELS = ["batch8", "broken", "dtypes", "named_args", "nobatch", "varlen", "versioned"]
MODEL_NAMES = st.sampled_from([*MODELS, "missing", "", "BATCH8", "batch8 ", "..", "%2F"])
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
KEYS = [
    "inputs",
    "outputs",
    "id",
    "parameters",
    "name",
    "datatype",
    "shape",
    "data",
    "binary_data_size",
    "binary_data",
    "binary_data_output",
    "priority",
    "timeout",
    "deadline_us",
    "IN",
    "OUT",
    "x",
    "scale",
]


# ----------------------------------------------------------------------------- client


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def call(
    svc: Service,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    *,
    chunked: bool = False,
) -> Answer:
    host, port = svc.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT_S)
    try:
        payload: Any = body
        if chunked and body is not None:
            payload = iter([body[: len(body) // 2], body[len(body) // 2 :]])
        conn.request(method, path, payload, headers or {}, encode_chunked=chunked)
        response = conn.getresponse()
        data = response.read()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, data)
    except TimeoutError:
        pytest.fail(
            f"no answer within {REQUEST_TIMEOUT_S} s to {method} {path} "
            f"headers={headers!r} body={(body or b'')[:300]!r}"
        )
    finally:
        conn.close()


def check(answer: Answer, method: str, what: str) -> None:
    """No 5xx but 503; every non-2xx answer carries a JSON {"error": "<string>"}."""
    assert answer.status < 500 or answer.status == 503, (
        f"{what} -> {answer.status} {answer.body[:500]!r}"
    )
    if answer.status < 300 or method == "HEAD":
        return
    body = answer.body
    encoding = answer.headers.get("content-encoding")
    if encoding == "gzip":
        body = gzip.decompress(body)
    elif encoding == "deflate":
        body = zlib.decompress(body)
    try:
        parsed = json.loads(body)
    except ValueError:
        pytest.fail(f"{what} -> {answer.status} with a body that is not JSON: {body[:300]!r}")
    assert isinstance(parsed, dict) and isinstance(parsed.get("error"), str), (
        f"{what} -> {answer.status} without a string 'error': {body[:300]!r}"
    )


def fire(
    svc: Service,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    *,
    chunked: bool = False,
) -> Answer:
    answer = call(svc, method, path, body, headers, chunked=chunked)
    what = f"{method} {path} headers={headers!r} body={(body or b'')[:300]!r}"
    check(answer, method, what)
    return answer


def infer_json(svc: Service, model: str, inputs: list[dict[str, Any]]) -> dict[str, Any]:
    body = json.dumps({"inputs": inputs}).encode()
    answer = call(svc, "POST", f"/v2/models/{model}/infer", body)
    assert answer.status == 200, answer.body[:500]
    return {o["name"]: o for o in json.loads(answer.body)["outputs"]}


def assert_still_serving(svc: Service) -> None:
    """Health, and a correct answer from the quick models (no batching delay)."""
    assert call(svc, "GET", "/v2/health/ready").status == 200
    data = [1.5, -2.0, 3.0, 4.0, 5.0, 6.0]
    out = infer_json(svc, "nobatch", [_tensor("IN", "FP32", [2, 3], data)])["OUT"]
    assert out["shape"] == [3, 2]
    assert out["data"] == [1.5, 4.0, -2.0, 5.0, 3.0, 6.0]
    out = infer_json(
        svc,
        "named_args",
        [_tensor("x", "FP32", [1, 3], [1.0, 2.0, 3.0]), _tensor("scale", "FP32", [1, 1], [2.5])],
    )["OUTPUT__0"]
    assert out["data"] == [2.5, 5.0, 7.5]


def _tensor(name: str, datatype: str, shape: list[int], data: list[Any]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}


# ----------------------------------------------------------------------------- strategies

LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-3, max_value=8)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from([*KEYS, *DATATYPES, *MODELS])
)
JSON_VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=24,
)
#: bodies shaped like an infer request, so the fuzz reaches past the first checks.
INFER_LIKE = st.fixed_dictionaries(
    {"inputs": st.lists(st.dictionaries(st.sampled_from(KEYS), JSON_VALUES, max_size=6))},
    optional={"outputs": JSON_VALUES, "id": JSON_VALUES, "parameters": JSON_VALUES},
)
PRINTABLE = st.text(
    alphabet=st.sampled_from(string.ascii_letters + string.digits + " -_.+:/=,;"), max_size=24
)


def dump(value: Any, ascii_only: bool) -> bytes:
    if ascii_only:
        return json.dumps(value).encode()
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


#: the inputs of a valid request, [(name, datatype, shape, values)], for each of the quick
#: models (batching delays would slow the fuzz down).
def _valid_inputs(model: str) -> list[tuple[str, str, list[int], list[Any]]]:
    if model == "nobatch":
        return [("IN", "FP32", [2, 3], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])]
    if model == "named_args":
        return [("x", "FP32", [1, 3], [1.0, 2.0, 3.0]), ("scale", "FP32", [1, 1], [3.0])]
    if model == "versioned":
        return [("IN", "INT32", [1, 1], [7])]
    values: dict[str, list[Any]] = {"BOOL": [True, False], "BYTES": ["ab", ""]}
    return [
        (f"IN_{dt}", dt, [1, 2], values.get(dt, [1, 2] if dt != "BF16" else [0x3F80, 0x4000]))
        for dt in DATATYPES
    ]


QUICK_MODELS = ["nobatch", "named_args", "versioned", "dtypes"]


def _binary(datatype: str, values: list[Any]) -> bytes:
    if datatype == "BYTES":
        raw = [v.encode() for v in values]
        return b"".join(len(v).to_bytes(4, "little") + v for v in raw)
    return np.asarray(values, dtype=NUMPY[datatype]).tobytes()


@dataclass
class Draft:
    """An infer request under construction: JSON header items plus each input's binary."""

    path: str
    header: dict[str, Any]
    binaries: list[bytes | None]
    length_delta: int = 0
    length_text: str | None = None
    tail_extra: bytes = b""
    tail_cut: int = 0

    def encode(self, ascii_only: bool) -> tuple[bytes, dict[str, str]]:
        head = dump(self.header, ascii_only)
        tail = b"".join(b for b in self.binaries if b is not None) + self.tail_extra
        if self.tail_cut:
            tail = tail[: -self.tail_cut]
        headers: dict[str, str] = {}
        if tail or self.length_delta or self.length_text is not None:
            headers[HEADER_LENGTH] = self.length_text or str(len(head) + self.length_delta)
        return head + tail, headers


def _draft(path: str, model: str, binary: list[bool]) -> Draft:
    """A valid request; `binary[i]` sends input i in binary (BF16 always is)."""
    items, binaries = [], []
    for (name, datatype, shape, values), as_binary in zip(
        _valid_inputs(model), binary, strict=True
    ):
        item: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
        if as_binary or datatype == "BF16":
            data = _binary(datatype, values)
            item["parameters"] = {"binary_data_size": len(data)}
            binaries.append(data)
        else:
            item["data"] = values
            binaries.append(None)
        items.append(item)
    return Draft(f"{path}/infer", {"inputs": items}, binaries)


@st.composite
def valid_drafts(draw: st.DrawFn) -> Draft:
    model = draw(st.sampled_from(QUICK_MODELS))
    path = f"/v2/models/{model}"
    if model == "versioned":
        path += draw(st.sampled_from(["", "/versions/1", "/versions/2"]))
    count = len(_valid_inputs(model))
    draft = _draft(path, model, draw(st.lists(st.booleans(), min_size=count, max_size=count)))
    if draw(st.booleans()):
        draft.header["id"] = draw(st.text(max_size=10))
    return draft


def _mutate(draw: st.DrawFn, draft: Draft) -> str:  # noqa: C901 (one branch per mutation)
    items: list[dict[str, Any]] = draft.header["inputs"]
    index = draw(st.integers(0, len(items) - 1))
    item = items[index]
    kind = draw(
        st.sampled_from(
            [
                "name",
                "datatype",
                "shape",
                "data",
                "binary_data_size",
                "input_parameters",
                "drop_field",
                "drop_input",
                "duplicate_input",
                "parameters",
                "outputs",
                "id",
                "length",
                "tail",
                "inputs",
            ]
        )
    )
    if kind == "name":
        item["name"] = draw(st.text(max_size=8) | st.sampled_from(KEYS) | JSON_VALUES)
    elif kind == "datatype":
        item["datatype"] = draw(st.sampled_from([*DATATYPES, "fp32", "TYPE_FP32", ""]) | LEAVES)
    elif kind == "shape":
        item["shape"] = draw(
            st.lists(st.integers(-2, 5) | st.integers(-(2**64), 2**64), max_size=4) | JSON_VALUES
        )
    elif kind == "data":
        item.pop("parameters", None)
        draft.binaries[index] = None
        item["data"] = draw(JSON_VALUES | st.lists(LEAVES, max_size=8))
    elif kind == "binary_data_size":
        item["parameters"] = {"binary_data_size": draw(LEAVES)}
    elif kind == "input_parameters":
        item["parameters"] = draw(JSON_VALUES)
    elif kind == "drop_field":
        if item:
            item.pop(draw(st.sampled_from(sorted(item))))
    elif kind == "drop_input":
        items.pop(index)
        draft.binaries.pop(index)
    elif kind == "duplicate_input":
        items.append(dict(item))
        draft.binaries.append(draft.binaries[index])
    elif kind == "parameters":
        draft.header["parameters"] = draw(
            st.dictionaries(
                st.sampled_from(
                    ["priority", "timeout", "deadline_us", "binary_data_output", "sequence_id"]
                ),
                LEAVES,
                max_size=3,
            )
            | JSON_VALUES
        )
    elif kind == "outputs":
        draft.header["outputs"] = draw(
            st.lists(
                st.fixed_dictionaries(
                    {"name": st.sampled_from(["OUT", "OUTPUT__0", "OUT_FP32", "nope"])},
                    optional={"parameters": st.dictionaries(st.just("binary_data"), LEAVES)},
                ),
                max_size=3,
            )
            | JSON_VALUES
        )
    elif kind == "id":
        draft.header["id"] = draw(JSON_VALUES)
    elif kind == "length":
        draft.length_delta = draw(st.integers(-12, 12))
        draft.length_text = draw(st.none() | PRINTABLE)
    elif kind == "tail":
        draft.tail_extra = draw(st.binary(max_size=16))
        draft.tail_cut = draw(st.integers(0, 6))
    elif kind == "inputs":
        draft.header["inputs"] = draw(JSON_VALUES)
    return kind if draft.header["inputs"] else "inputs"


@st.composite
def near_valid(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str], list[str]]:
    draft = draw(valid_drafts())
    done: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        done.append(_mutate(draw, draft))
        if done[-1] == "inputs":  # the input items are gone: nothing left to mutate
            break
    body, headers = draft.encode(draw(st.booleans()))
    return draft.path, body, headers, done


def _segments() -> st.SearchStrategy[str]:
    words = st.sampled_from(
        [
            "v2",
            "models",
            "health",
            "live",
            "ready",
            "repository",
            "index",
            "stats",
            "config",
            "infer",
            "versions",
            "1",
            "2",
            "0",
            "03",
            "-1",
            "",
            "..",
            ".",
            *MODELS,
        ]
    )
    return (
        words
        | st.text(max_size=6).map(lambda t: quote(t, safe=""))
        | st.binary(max_size=4).map(lambda b: quote_from_bytes(b, safe=""))
    )


# ----------------------------------------------------------------------------- tests


def test_base_requests_are_valid(service: Service) -> None:
    """The unmutated drafts are valid requests, so the mutations start from something real."""
    for model in QUICK_MODELS:
        for binary in (False, True):
            draft = _draft(f"/v2/models/{model}", model, [binary] * len(_valid_inputs(model)))
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
    encoding=st.none() | st.sampled_from(["gzip", "deflate", "identity", "br", "GZIP", ""]),
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
    | st.tuples(st.sampled_from(MODELS), _segments()).map(
        lambda mv: ["models", mv[0], "versions", mv[1]]
    ),
    segments=st.lists(_segments(), max_size=4),
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


def _nest(depth: int) -> str:
    return "[" * depth + "1.0" + "]" * depth


def _nested_body(depth: int) -> bytes:
    head = '{"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2, 3], "data": '
    return (head + _nest(depth) + "}]}").encode()


def test_json_nested_past_the_parser_depth_limit(service: Service) -> None:
    answer = fire(service, "POST", "/v2/models/nobatch/infer", _nested_body(2000))
    assert answer.status == 400


def test_empty_variable_dim(service: Service) -> None:
    body = json.dumps({"inputs": [_tensor("IN", "INT32", [1, 0], [])]}).encode()
    answer = fire(service, "POST", "/v2/models/varlen/infer", body)
    if answer.status == 200:
        assert json.loads(answer.body)["outputs"][0]["data"] == [0]


# ------------------------------------------------------------------- past bugs


@pytest.mark.parametrize(
    "version",
    ["%C2%B2", "9" * 5000],
    ids=["superscript-two", "5000-digits"],
)
@pytest.mark.parametrize("action", ["ready", "infer"])
def test_version_that_is_digits_but_no_int(service: Service, version: str, action: str) -> None:
    method = "POST" if action == "infer" else "GET"
    path = f"/v2/models/versioned/versions/{version}/{action}"
    answer = fire(service, method, path, b"{}" if method == "POST" else None)
    assert answer.status == 400


def test_json_data_nested_just_within_the_parser_depth_limit(service: Service) -> None:
    answer = fire(service, "POST", "/v2/models/nobatch/infer", _nested_body(1000))
    assert answer.status == 400


def test_still_serving_after_the_fuzz(service: Service) -> None:
    assert_still_serving(service)
    # batch8 waits up to 1 s for a batch: one request only
    out = infer_json(service, "batch8", [_tensor("IN", "FP32", [1, 4], [1.0, -2.0, 0.5, 8.0])])
    assert out["OUT"]["shape"] == [1, 4]
    assert out["OUT"]["data"] == [2.0, -4.0, 1.0, 16.0]
