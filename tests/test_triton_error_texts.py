"""The status and text of each error a client can see, as tritonserver 2.51 answers them (read
off the real server on the same requests, HTTP and gRPC): Triton's clients and examples match on
these texts."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Service
from tests.test_repository_control import _call

BAD_VERSION = (
    "failed to get model version from specified version string '{}' (details: stol), "
    "version should be an integral value > 0"
)
UNKNOWN = "Request for unknown model: 'nosuch' is not found"
ONE = {"name": "IN", "datatype": "FP32", "shape": [1, 4], "data": [1.0] * 4}


@pytest.mark.parametrize(
    ("method", "path", "status", "error"),
    [
        ("GET", "/v2/models/nosuch", 404, UNKNOWN),
        ("GET", "/v2/models/nosuch/config", 404, UNKNOWN),
        ("GET", "/v2/models/nosuch/stats", 400, "requested model 'nosuch' is not available"),
        (
            "GET",
            "/v2/models/batch8/versions/7",
            404,
            "Request for unknown model: 'batch8' version 7 is not found",
        ),
        (
            "GET",
            "/v2/models/batch8/versions/7/config",
            404,
            "Request for unknown model: 'batch8' version 7 is not found",
        ),
        ("GET", "/v2/models/batch8/versions/7/ready", 400, "Model version not ready"),
        ("GET", "/v2/models/nosuch/ready", 400, "Model version not ready"),
        (
            "GET",
            "/v2/models/batch8/versions/7/stats",
            400,
            "requested model version is not available for model 'batch8'",
        ),
        # Triton's routes take digits alone for a version
        ("GET", "/v2/models/batch8/versions/abc", 404, "Not Found"),
        ("GET", "/v2/models/batch8/versions/abc/ready", 404, "Not Found"),
        ("GET", "/v2/nosuch", 404, "Not Found"),
        # a known route, another method
        ("GET", "/v2/repository/index", 405, "Method Not Allowed"),
        ("GET", "/v2/models/batch8/infer", 405, "Method Not Allowed"),
        ("GET", "/v2/models/batch8/versions/1/infer", 405, "Method Not Allowed"),
        ("POST", "/v2/models/batch8", 405, "Method Not Allowed"),
        ("PUT", "/v2/health/ready", 405, "Method Not Allowed"),
        ("DELETE", "/v2/models/batch8/config", 405, "Method Not Allowed"),
        ("GET", "/v2/repository/models/batch8/load", 405, "Method Not Allowed"),
    ],
)
def test_http_errors_read_as_triton(
    service: Service, method: str, path: str, status: int, error: str
) -> None:
    assert _call(service, method, path) == (status, {"error": error})


@pytest.mark.parametrize(
    ("path", "status", "error"),
    [
        ("/v2/models/nosuch/infer", 404, UNKNOWN),
        (
            "/v2/models/batch8/versions/7/infer",
            404,
            "Request for unknown model: 'batch8' version 7 is not found",
        ),
        ("/v2/models/batch8/versions/abc/infer", 404, "Not Found"),
    ],
)
def test_http_infer_errors_read_as_triton(
    service: Service, path: str, status: int, error: str
) -> None:
    assert _call(service, "POST", path, {"inputs": [ONE]}) == (status, {"error": error})


def _grpc_error(service: Service, call: str, *args: str) -> tuple[str, str]:
    client = grpcclient.InferenceServerClient(service.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as caught:
            getattr(client, call)(*args)
    finally:
        client.close()
    return str(caught.value.status()), caught.value.message()


def test_grpc_bad_version_string_reads_as_triton(service: Service) -> None:
    wrong = ("StatusCode.INVALID_ARGUMENT", BAD_VERSION.format("wrong_specification"))
    assert _grpc_error(service, "get_model_metadata", "batch8", "wrong_specification") == wrong
    assert _grpc_error(service, "get_model_config", "batch8", "abc") == (
        "StatusCode.INVALID_ARGUMENT",
        BAD_VERSION.format("abc"),
    )
    tensor = grpcclient.InferInput("IN", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    client = grpcclient.InferenceServerClient(service.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.infer("batch8", [tensor], model_version="wrong_specification")
    finally:
        client.close()
    assert caught.value.message() == BAD_VERSION.format("wrong_specification")


def test_grpc_unknown_version_and_statistics_read_as_triton(service: Service) -> None:
    assert _grpc_error(service, "get_model_metadata", "batch8", "7") == (
        "StatusCode.NOT_FOUND",
        "Request for unknown model: 'batch8' version 7 is not found",
    )
    assert _grpc_error(service, "get_inference_statistics", "nosuch") == (
        "StatusCode.INVALID_ARGUMENT",
        "requested model 'nosuch' is not available",
    )
