"""Decoupled models end to end: Triton-shaped model.py files that answer a request zero or
more times, served by `sluice serve` and driven through tritonclient.grpc streaming, HTTP
generate / generate_stream on loopback, and asynchronous jobs; cancellation."""

from __future__ import annotations

import queue
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import HERE, Service, serving_alone, wait_until

MODELS = HERE / "decoupled_repo"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    repo = tmp_path_factory.mktemp("decoupled") / "models"
    shutil.copytree(MODELS, repo)
    with serving_alone(repo) as svc:
        yield svc


@pytest.fixture
def grpc_client(service: Service) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(service.grpc_url) as client:
        yield client


def _grpc_input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _repeat_inputs(values: list[int], delay_ms: int = 0, wait_ms: int = 0) -> list[Any]:
    return [
        _grpc_input("IN", np.array(values, np.int32), "INT32"),
        _grpc_input("DELAY", np.full(len(values), delay_ms, np.uint32), "UINT32"),
        _grpc_input("WAIT", np.array([wait_ms], np.uint32), "UINT32"),
    ]


class Stream:
    """A tritonclient.grpc stream whose callback's results are taken in order."""

    def __init__(self, client: grpcclient.InferenceServerClient) -> None:
        self.client = client
        self.results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def take(self, count: int) -> list[tuple[Any, Any]]:
        return [self.results.get(timeout=60) for _ in range(count)]

    def until_final(self) -> list[tuple[Any, Any]]:
        taken = []
        while True:
            result, error = self.results.get(timeout=60)
            taken.append((result, error))
            if result is not None and _final(result):
                return taken


def _final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


@pytest.fixture
def stream(grpc_client: grpcclient.InferenceServerClient) -> Iterator[Stream]:
    own = Stream(grpc_client)
    try:
        yield own
    finally:
        grpc_client.stop_stream()


# -- gRPC ModelStreamInfer ----------------------------------------------------------------------


def test_repeat_streams_one_response_per_element_in_order(stream: Stream) -> None:
    values = [4, 2, 0, 1, 9, 7]
    stream.client.async_stream_infer("repeat", _repeat_inputs(values, 5), request_id="r")
    answers = stream.take(len(values))
    assert all(error is None for _, error in answers)
    assert [int(r.as_numpy("OUT")[0]) for r, _ in answers] == values
    assert [int(r.as_numpy("IDX")[0]) for r, _ in answers] == list(range(len(values)))
    assert {r.get_response().id for r, _ in answers} == {"r"}
    # the final flag came alone, and was not asked for: no message, and none was final
    assert not any(_final(r) for r, _ in answers)


def test_the_empty_final_response_only_when_asked_for(stream: Stream) -> None:
    n = np.array([3], np.int32)
    stream.client.async_stream_infer(
        "empty_final",
        [_grpc_input("N", n, "INT32")],
        request_id="e",
        enable_empty_final_response=True,
    )
    answers = stream.until_final()
    assert [e for _, e in answers] == [None] * 4
    assert [r.as_numpy("OUT").tolist() for r, _ in answers[:3]] == [[0], [1], [2]]
    last = answers[3][0].get_response()
    assert (last.id, last.model_name, list(last.outputs)) == ("e", "empty_final", [])
    assert [_final(r) for r, _ in answers] == [False, False, False, True]


def test_zero_responses_and_the_final_flag(stream: Stream) -> None:
    stream.client.async_stream_infer(
        "empty_final",
        [_grpc_input("N", np.array([0], np.int32), "INT32")],
        enable_empty_final_response=True,
    )
    ((result, error),) = stream.until_final()
    assert error is None and result.as_numpy("OUT") is None


def test_an_error_mid_stream_answers_in_band_and_the_stream_goes_on(stream: Stream) -> None:
    stream.client.async_stream_infer(
        "mid_error", [_grpc_input("N", np.array([5], np.int32), "INT32")], request_id="m"
    )
    (first, e1), (_, error), (last, e3) = stream.take(3)
    assert e1 is None and first.as_numpy("OUT").tolist() == [5]
    assert isinstance(error, InferenceServerException) and "out of tokens" in error.message()
    assert e3 is None and last.as_numpy("OUT").tolist() == [6] and _final(last)


def test_an_execute_that_raises_ends_the_request_with_tritons_message(stream: Stream) -> None:
    stream.client.async_stream_infer(
        "mid_error", [_grpc_input("N", np.array([-1], np.int32), "INT32")]
    )
    ((_, error),) = stream.take(1)
    assert error.message() == (
        "Failed to process the request(s) for model 'mid_error', message: "
        "TritonModelException: negative N"
    )


def test_an_ordinary_model_streams_its_one_answer_as_final(stream: Stream) -> None:
    text = np.array([b"hi"], np.object_)
    stream.client.async_stream_infer("echo", [_grpc_input("text_input", text, "BYTES")])
    ((result, error),) = stream.until_final()
    assert error is None and result.as_numpy("text_output").tolist() == [b"hi {}"]


def test_model_infer_refuses_a_decoupled_model(
    grpc_client: grpcclient.InferenceServerClient,
) -> None:
    with pytest.raises(InferenceServerException) as err:
        grpc_client.infer("repeat", _repeat_inputs([1]))
    assert str(err.value.status()) == "StatusCode.UNIMPLEMENTED"
    assert err.value.message() == (
        "ModelInfer RPC doesn't support models with decoupled transaction policy"
    )


def test_http_infer_refuses_a_decoupled_model_with_501(service: Service) -> None:
    with httpclient.InferenceServerClient(service.http_url) as client:
        values = httpclient.InferInput("N", [1], "INT32")
        values.set_data_from_numpy(np.array([1], np.int32))
        with pytest.raises(InferenceServerException) as err:
            client.infer("empty_final", [values])
    assert err.value.status() == "501"
    assert "HTTP end point doesn't support models with decoupled transaction policy" in str(
        err.value
    )


def test_a_cancelled_stream_stops_the_model(
    grpc_client: grpcclient.InferenceServerClient, tmp_path: Path
) -> None:
    marker = tmp_path / "stopped"
    own = Stream(grpc_client)
    text = np.array([str(marker).encode()], np.object_)
    grpc_client.async_stream_infer("until_cancelled", [_grpc_input("MARKER", text, "BYTES")])
    own.take(3)  # it runs
    grpc_client.stop_stream(cancel_requests=True)
    wait_until(marker.exists, "the model to see its request cancelled")
    # the instance is free again: the next request runs
    again = tmp_path / "again"
    own = Stream(grpc_client)
    text = np.array([str(again).encode()], np.object_)
    grpc_client.async_stream_infer("until_cancelled", [_grpc_input("MARKER", text, "BYTES")])
    own.take(1)
    grpc_client.stop_stream(cancel_requests=True)
    wait_until(again.exists, "the second request to be cancelled too")
