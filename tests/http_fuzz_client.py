"""A plain http.client caller for the HTTP fuzz tests, and the checks every answer must pass.

Whatever arrives, the server must answer: never a 5xx other than 503, every non-2xx with a
JSON body holding a string "error", no hang.
"""

from __future__ import annotations

import gzip
import http.client
import json
import zlib
from dataclasses import dataclass
from typing import Any

import pytest

from tests.conftest import Service

#: seconds any one request may take; nothing here should come close.
REQUEST_TIMEOUT_S = 30.0
HEADER_LENGTH = "Inference-Header-Content-Length"


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
    out = infer_json(svc, "nobatch", [tensor_json("IN", "FP32", [2, 3], data)])["OUT"]
    assert out["shape"] == [3, 2]
    assert out["data"] == [1.5, 4.0, -2.0, 5.0, 3.0, 6.0]
    out = infer_json(
        svc,
        "named_args",
        [
            tensor_json("x", "FP32", [1, 3], [1.0, 2.0, 3.0]),
            tensor_json("scale", "FP32", [1, 1], [2.5]),
        ],
    )["OUTPUT__0"]
    assert out["data"] == [2.5, 5.0, 7.5]


def tensor_json(name: str, datatype: str, shape: list[int], data: list[Any]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "data": data}
