"""Compressed answers, as Triton 2.51 sends them: only an infer response is compressed, in the
coding the client's Accept-Encoding prefers. aiohttp (under tritonclient.http.aio) names gzip
and deflate on every request but inflates none of the answers itself, so any other answer
compressed would reach the client as bytes it cannot read."""

from __future__ import annotations

import gzip
import http.client
import json
import zlib

import numpy as np
import pytest
import tritonclient.http.aio as aioclient
from sluice.shared.http_messages import response_coding

from tests.conftest import Service

X = np.arange(8, dtype=np.float32).reshape(2, 4)


def _infer_input() -> aioclient.InferInput:
    tensor = aioclient.InferInput("IN", list(X.shape), "FP32")
    tensor.set_data_from_numpy(X)
    return tensor


async def test_the_asyncio_client_reads_every_answer(service: Service) -> None:
    """NVIDIA's simple_http_aio_infer_client.py calls: each one an aiohttp request that
    accepts gzip and deflate."""
    async with aioclient.InferenceServerClient(service.http_url) as client:
        assert await client.is_server_live()
        assert (await client.get_server_metadata())["name"] == "triton"
        assert (await client.get_model_metadata("batch8"))["name"] == "batch8"
        assert (await client.get_model_config("batch8"))["max_batch_size"] == 8
        stats = await client.get_inference_statistics("batch8")
        assert stats["model_stats"][0]["name"] == "batch8"
        index = await client.get_model_repository_index()
        assert "batch8" in {entry["name"] for entry in index}
        result = await client.infer("batch8", [_infer_input()])
        np.testing.assert_array_equal(result.as_numpy("OUT"), X * 2)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
async def test_the_asyncio_client_gets_the_compression_it_asks_for(
    service: Service, algorithm: str
) -> None:
    async with aioclient.InferenceServerClient(service.http_url) as client:
        result = await client.infer(
            "batch8", [_infer_input()], response_compression_algorithm=algorithm
        )
    np.testing.assert_array_equal(result.as_numpy("OUT"), X * 2)


def _post(service: Service, path: str, body: bytes, accept: str) -> tuple[int, str | None, bytes]:
    host, port = service.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body, {"Accept-Encoding": accept})
        response = conn.getresponse()
        return response.status, response.getheader("content-encoding"), response.read()
    finally:
        conn.close()


INFER = json.dumps(
    {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [2, 4], "data": X.ravel().tolist()}]}
).encode()


@pytest.mark.parametrize(
    ("accept", "coding", "inflate"),
    [("gzip", "gzip", gzip.decompress), ("deflate", "deflate", zlib.decompress)],
)
def test_an_infer_response_is_compressed_as_accepted(
    service: Service, accept: str, coding: str, inflate: object
) -> None:
    status, encoding, body = _post(service, "/v2/models/batch8/infer", INFER, accept)
    assert (status, encoding) == (200, coding)
    assert callable(inflate)
    assert json.loads(inflate(body))["outputs"][0]["data"] == (X * 2).ravel().tolist()


def test_other_answers_are_never_compressed(service: Service) -> None:
    status, encoding, body = _post(service, "/v2/repository/index", b"{}", "gzip, deflate")
    assert (status, encoding) == (200, None)
    assert "batch8" in {entry["name"] for entry in json.loads(body)}
    # an infer error is sent as it is, as Triton sends it
    status, encoding, body = _post(service, "/v2/models/batch8/infer", b"{", "gzip")
    assert (status, encoding) == (400, None)
    assert "error" in json.loads(body)


@pytest.mark.parametrize(
    ("accept", "coding"),
    [
        (b"gzip, deflate", b"gzip"),
        (b"deflate, gzip", b"deflate"),
        (b"gzip;q=0.5, deflate", b"deflate"),
        (b"deflate;q=0.2, gzip;q=0.8", b"gzip"),
        (b"identity, gzip", None),
        (b"gzip;q=0.5, identity;q=0.9", None),
        (b"gzip;q=0", None),
        (b"br", None),
        (b"*", None),
        (b"", None),
        (b"gzip;q=x, deflate;q=0.1", b"deflate"),
        (b" GZIP ", b"gzip"),
    ],
)
def test_the_coding_is_the_one_the_client_weighs_highest(
    accept: bytes, coding: bytes | None
) -> None:
    assert response_coding(accept) == coding
