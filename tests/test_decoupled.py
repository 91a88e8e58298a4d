"""Decoupled models end to end: Triton-shaped model.py files that answer a request zero or
more times, served by `sluice serve` and driven through tritonclient.grpc streaming, HTTP
generate / generate_stream on loopback, and asynchronous jobs; cancellation."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import HERE, Service, serving_alone, wait_until
from tests.test_jobs import _events as job_events

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


# -- HTTP generate and generate_stream ----------------------------------------------------------


@contextlib.contextmanager
def _post(service: Service, path: str, body: Any) -> Iterator[http.client.HTTPResponse]:
    """A POST on a loopback connection of its own, closed on leaving."""
    host, port = service.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode())
        response = conn.getresponse()
        try:
            yield response
        finally:
            response.close()  # a streamed response holds the socket
    finally:
        conn.close()


def _generate(service: Service, model: str, body: Any) -> tuple[int, dict[str, Any]]:
    with _post(service, f"/v2/models/{model}/generate", body) as response:
        return response.status, json.loads(response.read())


def _events(response: http.client.HTTPResponse) -> list[dict[str, Any]]:
    """Every `data: {...}` event until the server ends the stream."""
    text = response.read().decode()
    blocks = [b for b in text.split("\n\n") if b]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), text
    return [json.loads(b.removeprefix("data: ")) for b in blocks]


def test_generate_stream_sends_each_response_as_an_event(service: Service) -> None:
    body = {"id": "g1", "IN": [3, 1, 4], "DELAY": [1, 1, 1], "parameters": {"WAIT": 0}}
    with _post(service, "/v2/models/repeat/generate_stream", body) as response:
        assert response.status == 200
        assert response.getheader("content-type") == "text/event-stream; charset=utf-8"
        events = _events(response)
    assert events == [
        {"id": "g1", "model_name": "repeat", "model_version": "1", "OUT": v, "IDX": i}
        for i, v in enumerate([3, 1, 4])
    ]


def test_generate_maps_inputs_and_parameters_and_wants_one_response(service: Service) -> None:
    """An ordinary model: `text_input` names an input, the other keys are parameters; the
    versioned path too."""
    body = {"text_input": "hello", "parameters": {"temperature": 0.5, "stream": False}}
    status, answer = _generate(service, "echo/versions/1", body)
    assert status == 200
    assert answer == {
        "model_name": "echo",
        "model_version": "1",
        "text_output": 'hello {"stream": false, "temperature": 0.5}',
    }
    body = {"IN": [1, 2], "DELAY": [0, 0], "WAIT": 0}
    assert _generate(service, "repeat", body) == (200, {"error": NOT_ONE})
    assert _generate(service, "repeat", {"IN": [8], "DELAY": [0], "WAIT": 0})[1]["OUT"] == 8


def test_generate_refuses_what_does_not_fit(service: Service) -> None:
    status, answer = _generate(service, "repeat", {"IN": [1], "DELAY": [0], "WAIT": [1, 2]})
    assert status == 400
    assert answer["error"] == "The schema can not convert input 'WAIT' to tensor with proper shape"
    status, answer = _generate(service, "echo", {"text_input": "x", "nested": {"a": 1}})
    assert status == 400 and "parameter 'nested'" in answer["error"]
    status, answer = _generate(service, "nowhere", {"text_input": "x"})
    assert status == 404 and "unknown model: 'nowhere'" in answer["error"]


def test_generate_stream_errors_in_band_and_first_as_400(service: Service) -> None:
    with _post(service, "/v2/models/mid_error/generate_stream", {"N": 2}) as response:
        assert response.status == 200
        assert _events(response) == [
            {"model_name": "mid_error", "model_version": "1", "OUT": 2},
            {"error": "out of tokens"},
            {"model_name": "mid_error", "model_version": "1", "OUT": 3},
        ]
    with _post(service, "/v2/models/mid_error/generate_stream", {"N": -1}) as response:
        assert response.status == 400
        (event,) = _events(response)
    assert "negative N" in event["error"]
    status, answer = _generate(service, "mid_error", {"N": 1})
    assert status == 400 and answer == {"error": "out of tokens"}


def test_a_closed_generate_stream_stops_the_model(service: Service, tmp_path: Path) -> None:
    marker = tmp_path / "stopped"
    body = {"MARKER": str(marker)}
    with _post(service, "/v2/models/until_cancelled/generate_stream", body) as response:
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # it runs
    wait_until(marker.exists, "the model to see its request cancelled")


def test_generate_stream_sends_each_token_as_it_is_made_and_keeps_the_connection(
    service: Service, tmp_path: Path
) -> None:
    """requests' iter_lines, the usual Python client: each token reaches it before the model
    makes the next (the model waits for the cue this test gives once it has the token, so a
    token held back until the end would never come), and the connection then serves on."""
    cues = tmp_path / "cues"
    os.mkfifo(cues)
    cue = os.open(cues, os.O_RDWR)  # a writer from now on: the model's open does not wait
    body = {"CUES": str(cues), "N": 3}
    url = f"http://{service.http_url}/v2/models/on_cue/generate_stream"
    try:
        with requests.Session() as session:
            with session.post(url, json=body, stream=True, timeout=(10, 60)) as response:
                assert response.headers["transfer-encoding"] == "chunked"
                assert response.headers["connection"] == "keep-alive"
                address = response.raw.connection.sock.getsockname()
                tokens = []
                for line in response.iter_lines():
                    if line:
                        tokens.append(json.loads(line.removeprefix(b"data: "))["OUT"])
                        os.write(cue, b"!")  # cue the next token
            assert tokens == [0, 1, 2]
            with session.get(f"http://{service.http_url}/v2/health/ready", stream=True) as again:
                assert again.status_code == 200
                assert again.raw.connection.sock.getsockname() == address
    finally:
        os.close(cue)


NOT_ONE = (
    "generate expects model to produce exactly 1 response, use generate stream for model "
    "that generates various number of responses"
)


# -- asynchronous jobs ---------------------------------------------------------------------------


def _call(service: Service, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    host, port = service.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode())
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def _repeat_job(job_id: str, values: list[int], delay_ms: int) -> dict[str, Any]:
    n = len(values)
    return {
        "id": job_id,
        "inputs": [
            {"name": "IN", "datatype": "INT32", "shape": [n], "data": values},
            {"name": "DELAY", "datatype": "UINT32", "shape": [n], "data": [delay_ms] * n},
            {"name": "WAIT", "datatype": "UINT32", "shape": [1], "data": [0]},
        ],
    }


def test_a_job_keeps_every_response_in_order(service: Service) -> None:
    values = [5, 6, 7, 8]
    assert _call(service, "POST", "/v2/models/repeat/jobs", _repeat_job("dj1", values, 1))[0] == 202
    status, job = _call(service, "GET", "/v2/jobs/dj1?wait=30")
    assert status == 200
    assert (job["id"], job["status"], job["model_name"]) == ("dj1", "done", "repeat")
    outs = [{o["name"]: o["data"] for o in r["outputs"]} for r in job["responses"]]
    assert outs == [{"OUT": [v], "IDX": [i]} for i, v in enumerate(values)]


def test_job_events_report_each_response(service: Service) -> None:
    values = [1, 2, 3]
    assert (
        _call(service, "POST", "/v2/models/repeat/jobs", _repeat_job("dj2", values, 20))[0] == 202
    )
    events = job_events(service, "dj2")  # the stream ends after the last event
    responses = [data for name, data in events if name == "response"]
    assert [r["outputs"][0]["data"] for r in responses] == [[1], [2], [3]]
    assert events[-1] == ("status", {"id": "dj2", "status": "done"})


def test_cancelling_a_running_job_stops_its_model(service: Service, tmp_path: Path) -> None:
    marker = tmp_path / "stopped"
    body = {
        "id": "dj3",
        "inputs": [{"name": "MARKER", "datatype": "BYTES", "shape": [1], "data": [str(marker)]}],
    }
    assert _call(service, "POST", "/v2/models/until_cancelled/jobs", body)[0] == 202
    wait_until(
        lambda: _call(service, "GET", "/v2/jobs/dj3")[1]["status"] == "running",
        "the job to run",
    )
    assert _call(service, "DELETE", "/v2/jobs/dj3")[0] == 200
    wait_until(marker.exists, "the model to see its job cancelled")
    status, job = _call(service, "GET", "/v2/jobs/dj3?wait=30")
    assert status == 200 and job["status"] == "done"
    assert [r["outputs"][0]["data"] for r in job["responses"]] == [
        [i] for i in range(len(job["responses"]))
    ]
