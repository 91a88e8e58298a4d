"""Triton's restricted APIs (--http-restricted-api, --grpc-restricted-protocol) beside
--auth-token, a `Bearer` scheme word in any case, and --metrics-auth-token: on a gateway of its
own, on the session service's Redis and workers, with Triton 2.51's statuses and texts."""

from __future__ import annotations

import http.client
from collections.abc import Iterator

import grpc
import numpy as np
import orjson
import pytest
from sluice.gateway.app import GatewayApp
from sluice.gateway.bearer import bearer_matches
from sluice.gateway.restricted_apis import GRPC_CATEGORIES, http_category
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from tests.conftest import Service, start_sluice, stop_service

Status = grpc.StatusCode
TOKEN = "t0ken"
ADMIN = "s3cret"
METRICS_TOKEN = "scrape"


@pytest.fixture(scope="module")
def gateway(service: Service) -> Iterator[Service]:
    args = [
        "--redis-url",
        service.redis_url,
        "--auth-token",
        TOKEN,
        "--metrics-auth-token",
        METRICS_TOKEN,
        "--http-restricted-api",
        "model-repository,model-config:admin-key=" + ADMIN,
        "--http-restricted-api",
        "statistics:stats-key=" + ADMIN,
        "--grpc-restricted-protocol",
        "model-repository,inference:admin-key=" + ADMIN,
    ]
    gateway = start_sluice("gateway", args)
    yield gateway
    stop_service(gateway)


def _http(
    url: str, method: str, path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, bytes]:
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body or None, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


BEARER = {"Authorization": f"Bearer {TOKEN}"}
HTTP_REFUSAL = b'{"error":"This API is restricted, expecting header \'admin-key\'"}'


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v2/repository/index"),
        ("POST", "/v2/repository/models/affine/load"),
        ("GET", "/v2/models/affine/config"),
        ("GET", "/v2/models/affine/versions/1/config"),
        ("PUT", "/v2/repository/index"),  # the refusal comes before the method's 405 or 404
    ],
)
def test_a_restricted_http_api_without_its_header_is_a_403(
    gateway: Service, method: str, path: str
) -> None:
    status, body = _http(gateway.http_url, method, path, BEARER)
    assert (status, body) == (403, HTTP_REFUSAL)
    status, body = _http(gateway.http_url, method, path, {**BEARER, "admin-key": "wrong"})
    assert (status, body) == (403, HTTP_REFUSAL)


def test_with_its_header_a_restricted_http_api_answers(gateway: Service) -> None:
    # the header's name in any case, as Triton (libevhtp) finds it; its value exactly
    admin = {**BEARER, "Admin-Key": ADMIN}
    status, body = _http(gateway.http_url, "POST", "/v2/repository/index", admin, b"{}")
    assert status == 200 and b"affine" in body
    status, body = _http(gateway.http_url, "GET", "/v2/models/affine/config", admin)
    assert status == 200 and orjson.loads(body)["name"] == "affine"
    status, body = _http(gateway.http_url, "GET", "/v2/models/stats", BEARER)
    expected = b'{"error":"This API is restricted, expecting header \'stats-key\'"}'
    assert (status, body) == (403, expected)
    stats = {**BEARER, "stats-key": ADMIN}
    assert _http(gateway.http_url, "GET", "/v2/models/affine/stats", stats)[0] == 200


def test_categories_not_restricted_answer_as_before(gateway: Service) -> None:
    assert _http(gateway.http_url, "GET", "/v2/health/ready", {})[0] == 200
    status, body = _http(gateway.http_url, "GET", "/v2", BEARER)
    assert status == 200 and "extensions" in orjson.loads(body)
    infer = orjson.dumps(
        {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    )
    status, body = _http(gateway.http_url, "POST", "/v2/models/affine/infer", BEARER, infer)
    assert status == 200 and orjson.loads(body)["outputs"][0]["data"] == [3, 5, 7, 9]


def test_the_token_is_still_needed_beside_the_header(gateway: Service) -> None:
    admin = {"admin-key": ADMIN}
    status, body = _http(gateway.http_url, "GET", "/v2/models/affine/config", admin)
    assert status == 401 and b"bearer token" in body


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "BeArEr"])
def test_the_bearer_scheme_word_is_taken_in_any_case(gateway: Service, scheme: str) -> None:
    headers = {"Authorization": f"{scheme} {TOKEN}"}
    assert _http(gateway.http_url, "GET", "/v2", headers)[0] == 200
    with grpc.insecure_channel(gateway.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = (("authorization", f"{scheme} {TOKEN}"),)
        assert stub.ServerMetadata(pb.ServerMetadataRequest(), metadata=metadata).extensions


@pytest.mark.parametrize("given", ["Basic " + TOKEN, "Bearer " + TOKEN + "x", TOKEN, "Bearer"])
def test_anything_but_the_bearer_token_is_refused(gateway: Service, given: str) -> None:
    assert _http(gateway.http_url, "GET", "/v2", {"Authorization": given})[0] == 401


def test_the_metrics_port_wants_its_own_token(gateway: Service) -> None:
    status, body = _http(gateway.metrics_url, "GET", "/metrics", BEARER)
    assert status == 401 and b"bearer token" in body
    status, body = _http(gateway.metrics_url, "GET", "/metrics", {"Authorization": "bearer scrape"})
    assert status == 200 and b"nv_inference_count" in body


# -- gRPC ---------------------------------------------------------------------------------------

GRPC_AUTH = ("authorization", f"Bearer {TOKEN}")
GRPC_ADMIN = ("triton-grpc-protocol-admin-key", ADMIN)
GRPC_REFUSAL = "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"


def _infer_request() -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="affine")
    tensor = request.inputs.add(name="X", datatype="FP32", shape=[1, 4])
    tensor.contents.fp32_contents.extend([1, 2, 3, 4])
    return request


def test_a_restricted_rpc_without_its_metadata_is_unavailable(gateway: Service) -> None:
    with grpc.insecure_channel(gateway.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls = [
            lambda metadata: stub.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=metadata),
            lambda metadata: stub.ModelInfer(_infer_request(), metadata=metadata),
            lambda metadata: list(
                stub.ModelStreamInfer(iter([_infer_request()]), metadata=metadata)
            ),
        ]
        for call in calls:
            for metadata in ((GRPC_AUTH,), (GRPC_AUTH, (GRPC_ADMIN[0], "wrong"))):
                with pytest.raises(grpc.RpcError) as err:
                    call(metadata)
                assert (err.value.code(), err.value.details()) == (Status.UNAVAILABLE, GRPC_REFUSAL)


def test_with_its_metadata_a_restricted_rpc_answers(gateway: Service) -> None:
    with grpc.insecure_channel(gateway.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = (GRPC_AUTH, GRPC_ADMIN)
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=metadata)
        assert "affine" in {m.name for m in index.models}
        answer = stub.ModelInfer(_infer_request(), metadata=metadata)
        y = np.frombuffer(answer.raw_output_contents[0], np.float32)
        np.testing.assert_array_equal(y, [3, 5, 7, 9])
        # HTTP's restriction of model-config is not gRPC's
        config = stub.ModelConfig(pb.ModelConfigRequest(name="affine"), metadata=(GRPC_AUTH,))
        assert config.config.name == "affine"
        assert stub.ServerLive(pb.ServerLiveRequest()).live


@pytest.mark.parametrize(
    ("given", "matches"),
    [
        (b"Bearer t0ken", True),
        (b"bearer t0ken", True),
        ("BEARER t0ken", True),  # gRPC metadata values are str
        (b"Bearer  t0ken", True),  # RFC 9110: one or more spaces
        (b"Bearer t0ken ", False),
        (b"Bearert0ken", False),
        (b"Basic t0ken", False),
        (b"t0ken", False),
        (b"", False),
        (None, False),
    ],
)
def test_a_bearer_value_matches_by_its_scheme_in_any_case_and_its_exact_token(
    given: bytes | str | None, matches: bool
) -> None:
    assert bearer_matches(given, TOKEN.encode()) is matches


# -- every endpoint has its category -----------------------------------------------------------

#: the routes that answer 404 for paths no endpoint serves.
CATCH_ALLS = {"_unknown_model_action", "_unknown_bulk_path"}


def test_every_http_route_has_a_category() -> None:
    """A route added without a category would be open whatever the restrictions say."""
    for route in GatewayApp._routes(GatewayApp.__new__(GatewayApp)):
        if route.endpoint.__name__ not in CATCH_ALLS:
            path = "/" + route.pattern.removesuffix("/**").replace("{", "").replace("}", "")
            assert http_category(path) is not None, path


def test_every_rpc_has_a_category() -> None:
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert {m.name for m in service.methods} | {"Check"} == set(GRPC_CATEGORIES)
