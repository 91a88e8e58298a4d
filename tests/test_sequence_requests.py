"""Requests to a model under Triton's sequence batcher, refused as tritonserver 2.51 refuses
them before it looks their sequence up: a batch of more than one, a request naming no
sequence; over HTTP (400) and gRPC (INVALID_ARGUMENT), with Triton's messages. Sequence
parameters of the wrong JSON type get Triton's message with a 400 (Triton's is a 500: its JSON
reader's errors are INTERNAL; bad input is never a 5xx here)."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Service, serving_alone

HERE = Path(__file__).resolve().parent
BATCH = (
    "inference request to model 'simple_sequence' must specify batch-size 1 due to "
    "requirements of sequence batcher"
)
NO_ID = (
    "inference request to model 'simple_sequence' must specify a non-zero or non-empty "
    "correlation ID"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    repo = tmp_path_factory.mktemp("sequences")
    shutil.copytree(HERE / "triton_examples_repo" / "simple_sequence", repo / "simple_sequence")
    with serving_alone(repo) as service:
        yield service


def _http(service: Service, rows: int, parameters: dict[str, object]) -> tuple[int, str]:
    body = {
        "inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [rows, 1], "data": [1] * rows}],
        "parameters": parameters,
    }
    request = urllib.request.Request(
        f"http://{service.http_url}/v2/models/simple_sequence/infer", json.dumps(body).encode()
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, ""
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())["error"]


@pytest.mark.parametrize(
    ("rows", "parameters", "message"),
    [
        (2, {"sequence_id": 7, "sequence_start": True}, BATCH),
        (1, {}, NO_ID),
        (1, {"sequence_id": 0, "sequence_start": True}, NO_ID),
        (1, {"sequence_id": "", "sequence_start": True}, NO_ID),
    ],
)
def test_http_refuses_what_the_sequence_batcher_refuses(
    served: Service, rows: int, parameters: dict[str, object], message: str
) -> None:
    assert _http(served, rows, parameters) == (400, message)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"sequence_id": -1}, "Unable to parse 'sequence_id': attempt to access JSON non-string"),
        ({"sequence_id": 9, "sequence_start": 1}, "Unable to parse 'sequence_start': attempt"),
    ],
)
def test_http_answers_an_unreadable_sequence_parameter_with_tritons_message(
    served: Service, parameters: dict[str, object], message: str
) -> None:
    status, error = _http(served, 1, parameters)
    assert status == 400 and error.startswith(message)


@pytest.mark.parametrize(("rows", "sequence_id", "message"), [(2, 7, BATCH), (1, 0, NO_ID)])
def test_grpc_refuses_what_the_sequence_batcher_refuses(
    served: Service, rows: int, sequence_id: int, message: str
) -> None:
    tensor = grpcclient.InferInput("INPUT", [rows, 1], "INT32")
    tensor.set_data_from_numpy(np.ones((rows, 1), np.int32))
    client = grpcclient.InferenceServerClient(served.grpc_url)
    with client, pytest.raises(InferenceServerException) as err:
        client.infer("simple_sequence", [tensor], sequence_id=sequence_id, sequence_start=True)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert err.value.message() == message
