"""In-flight batching end to end: the example charlm (iterative, decoupled) served by `sluice
serve`, one response per character through tritonclient.grpc streaming and HTTP
generate_stream; a short request finishes while a long one runs; a cancelled sequence frees
its slot; the tokens are counted in the metrics; Triton's interface (request rescheduling, and
the control inputs its iterative sequencer fills in)."""

from __future__ import annotations

import http.client
import json
import queue
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.charlm import build_charlm, greedy_texts
from tests.conftest import Service, serving_alone, wait_until

#: Triton's interface: a decoupled Python model rescheduled until it has sent N responses.
COUNTDOWN = textwrap.dedent(
    """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.sent = {}

        def execute(self, requests):
            for request in requests:
                n = pb_utils.get_input_tensor_by_name(request, "N").as_numpy().item()
                done = self.sent.pop(request.request_id(), 0) + 1
                out = pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.array([[done]], np.int32))]
                )
                sender = request.get_response_sender()
                if done < n:
                    self.sent[request.request_id()] = done
                    sender.send(out)
                    request.set_release_flags(
                        pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
                    )
                else:
                    sender.send(out, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    """
)
#: the countdown of the long request: its iterations outlast the sending of the short one.
LONG = 2000
COUNTDOWN_CONFIG = """
name: "countdown"
backend: "python"
max_batch_size: 4
input [ { name: "N", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
sequence_batching { iterative_sequence: true }
model_transaction_policy { decoupled: true }
"""

#: Triton's iterative sequencer's view: each iteration answers what the server said of it.
CONTROLS = textwrap.dedent(
    """
    import numpy as np
    import triton_python_backend_utils as pb_utils


    def value(request, name):
        return pb_utils.get_input_tensor_by_name(request, name).as_numpy().item()


    class TritonPythonModel:
        def initialize(self, args):
            self.steps = {}

        def execute(self, requests):
            for request in requests:
                step = self.steps.pop(request.request_id(), 0) + 1
                seen = [value(request, "START"), value(request, "READY"),
                        value(request, "CORRID"), request.flags(), request.correlation_id()]
                out = pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", np.array([seen], np.int64))]
                )
                sender = request.get_response_sender()
                if step < 3:
                    self.steps[request.request_id()] = step
                    sender.send(out)
                    request.set_release_flags(
                        pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
                    )
                else:
                    sender.send(out, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    """
)
CONTROLS_CONFIG = """
name: "controls"
backend: "python"
max_batch_size: 4
input [ { name: "N", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT64, dims: [ 5 ] } ]
sequence_batching {
  iterative_sequence: true
  control_input [
    { name: "START", control [ { kind: CONTROL_SEQUENCE_START, fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY",
      control [ { kind: CONTROL_SEQUENCE_READY, bool_false_true: [ false, true ] } ] },
    { name: "CORRID", control [ { kind: CONTROL_SEQUENCE_CORRID, data_type: TYPE_UINT64 } ] }
  ]
}
model_transaction_policy { decoupled: true }
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Path]]:
    repo = tmp_path_factory.mktemp("inflight")
    model_dir = build_charlm(repo)
    # the same model with a single slot: only a sequence that left lets the next one run
    one = repo / "charlm_one"
    (one / "1").mkdir(parents=True)
    for name in ("model.py", "model.pt"):
        (one / "1" / name).write_bytes((model_dir / "1" / name).read_bytes())
    config = (model_dir / "config.pbtxt").read_text()
    config = config.replace('"charlm"', '"charlm_one"').replace(
        "max_batch_size: 16", "max_batch_size: 1"
    )
    (one / "config.pbtxt").write_text(config)
    (repo / "countdown" / "1").mkdir(parents=True)
    (repo / "countdown" / "1" / "model.py").write_text(COUNTDOWN)
    (repo / "countdown" / "config.pbtxt").write_text(COUNTDOWN_CONFIG)
    (repo / "controls" / "1").mkdir(parents=True)
    (repo / "controls" / "1" / "model.py").write_text(CONTROLS)
    (repo / "controls" / "config.pbtxt").write_text(CONTROLS_CONFIG)
    with serving_alone(repo) as service:
        yield service, model_dir


def _text_input(text: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
    return tensor


class Stream:
    """A tritonclient.grpc stream; its responses taken in order as (request id, char, final)."""

    def __init__(self, client: grpcclient.InferenceServerClient) -> None:
        self.results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def take(self) -> tuple[str, str, bool]:
        result, error = self.results.get(timeout=60)
        assert error is None, error
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        output = result.as_numpy("text_output")
        char = "" if output is None else output.reshape(-1)[0].decode()
        return response.id, char, final


def test_a_stream_gets_one_response_per_character(served: tuple[Service, Path]) -> None:
    service, model_dir = served
    with grpcclient.InferenceServerClient(service.grpc_url) as client:
        stream = Stream(client)
        params = {"max_tokens": 30, "stop": ""}
        client.async_stream_infer("charlm", [_text_input("The ")], parameters=params)
        taken = [stream.take() for _ in range(30)]
        client.stop_stream()
    assert [final for _, _, final in taken] == [False] * 29 + [True]
    expected = greedy_texts(model_dir, {"a": "The "}, 1, **params)["a"]
    assert "".join(char for _, char, _ in taken) == expected


def test_generate_stream_sends_one_event_per_character(served: tuple[Service, Path]) -> None:
    """Triton's generate extension: `text_input` names the input, the other keys are request
    parameters."""
    service, model_dir = served
    host, port = service.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"text_input": "The ", "max_tokens": 30, "stop": ""}
    try:
        conn.request("POST", "/v2/models/charlm/generate_stream", body=json.dumps(body).encode())
        response = conn.getresponse()
        assert response.status == 200
        text = response.read().decode()
    finally:
        conn.close()
    events = [json.loads(b.removeprefix("data: ")) for b in text.split("\n\n") if b]
    assert len(events) == 30
    expected = greedy_texts(model_dir, {"a": "The "}, 1, max_tokens=30, stop="")["a"]
    assert "".join(e["text_output"] for e in events) == expected


def test_a_short_request_finishes_while_a_long_one_runs(served: tuple[Service, Path]) -> None:
    service, model_dir = served
    with grpcclient.InferenceServerClient(service.grpc_url) as client:
        stream = Stream(client)
        long = {"max_tokens": 1000, "stop": ""}
        client.async_stream_infer("charlm", [_text_input("A ")], request_id="long", parameters=long)
        short = {"max_tokens": 3, "stop": ""}
        client.async_stream_infer(
            "charlm", [_text_input("B")], request_id="short", parameters=short
        )
        texts = {"long": "", "short": ""}
        finals = []
        while len(finals) < 2:
            rid, char, final = stream.take()
            texts[rid] += char
            if final:
                finals.append((rid, len(texts["long"])))
        client.stop_stream()
    (first, long_so_far), (second, _) = finals
    assert (first, second) == ("short", "long")
    assert long_so_far < 1000  # the short one ended while the long one was generating
    assert texts["long"] == greedy_texts(model_dir, {"l": "A "}, 1, **long)["l"]
    assert texts["short"] == greedy_texts(model_dir, {"s": "B"}, 1, **short)["s"]


def test_a_cancelled_sequence_frees_its_slot(served: tuple[Service, Path]) -> None:
    """charlm_one has one slot: the second request runs only once the first one left it, cut
    short by its cancellation (it would otherwise run to its 5000 tokens)."""
    service, _ = served
    with grpcclient.InferenceServerClient(service.grpc_url) as client:
        stream = Stream(client)
        long = {"max_tokens": 5000, "stop": ""}
        client.async_stream_infer("charlm_one", [_text_input("x")], parameters=long)
        for _ in range(3):
            assert stream.take()[2] is False
        client.stop_stream(cancel_requests=True)
        stream = Stream(client)
        client.async_stream_infer(
            "charlm_one", [_text_input("y")], parameters={"max_tokens": 4, "stop": ""}
        )
        taken = [stream.take() for _ in range(4)]
        client.stop_stream()
    assert [final for _, _, final in taken] == [False, False, False, True]
    labels = '{model="charlm_one",version="1"}'
    cancelled = 'nv_inference_request_failure{model="charlm_one",reason="CANCELED",version="1"}'
    wait_until(lambda: _metrics(service).get(cancelled) == 1, "the cancellation counted")
    assert _metrics(service)[f"sluice_generation_tokens_total{labels}"] < 5000


def _metrics(service: Service) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{service.metrics_url}/metrics").read().decode()
    lines = text.splitlines()
    samples = (line.rsplit(" ", 1) for line in lines if line.startswith(("sluice_", "nv_")))
    return {name: float(value) for name, value in samples}


def test_generation_metrics_as_llm_servers_name_them(served: tuple[Service, Path]) -> None:
    service, _ = served
    test_a_stream_gets_one_response_per_character(served)
    labels = '{model="charlm",version="1"}'
    wanted = [
        f"sluice_generation_tokens_total{labels}",
        f"sluice_prompt_tokens_total{labels}",
        f"sluice_time_to_first_token_seconds_count{labels}",
        f"sluice_inter_token_latency_seconds_count{labels}",
        'sluice_num_requests_running{model="charlm"}',
        'sluice_num_requests_waiting{model="charlm"}',
    ]
    wait_until(lambda: all(name in _metrics(service) for name in wanted), "generation metrics")
    metrics = _metrics(service)
    assert metrics[f"sluice_generation_tokens_total{labels}"] >= 30
    assert metrics[f"sluice_prompt_tokens_total{labels}"] >= 5  # "The " and its start
    # one first token per request, every other token one gap
    firsts = metrics[f"sluice_time_to_first_token_seconds_count{labels}"]
    gaps = metrics[f"sluice_inter_token_latency_seconds_count{labels}"]
    assert firsts + gaps == metrics[f"sluice_generation_tokens_total{labels}"]
    # Triton's own families count the requests and iterations too
    assert metrics[f"nv_inference_request_success{labels}"] >= 1
    assert metrics[f"nv_inference_exec_count{labels}"] >= 30


def test_a_triton_model_rescheduling_its_requests_runs_in_flight(
    served: tuple[Service, Path],
) -> None:
    service, _ = served

    def count(n: int) -> list[grpcclient.InferInput]:
        tensor = grpcclient.InferInput("N", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[n]], np.int32))
        return [tensor]

    with grpcclient.InferenceServerClient(service.grpc_url) as client:
        results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        # long enough that the short one, sent just after it, joins while it runs even on a
        # loaded machine
        client.async_stream_infer("countdown", count(LONG), request_id="long")
        client.async_stream_infer("countdown", count(2), request_id="short")
        got: dict[str, list[int]] = {"long": [], "short": []}
        finals = []
        while len(finals) < 2:
            result, error = results.get(timeout=60)
            assert error is None, error
            rid = result.get_response().id
            got[rid].append(int(result.as_numpy("OUT").item()))
            if result.get_response().parameters["triton_final_response"].bool_param:
                finals.append((rid, len(got["long"])))
        client.stop_stream()
    assert got == {"long": list(range(1, LONG + 1)), "short": [1, 2]}
    (first, long_so_far), (second, _) = finals
    assert (first, second) == ("short", "long") and long_so_far < LONG


def test_an_iterative_triton_model_reads_the_controls_its_sequencer_fills_in(
    served: tuple[Service, Path],
) -> None:
    """As tritonserver 2.51: ids 1, 2, ... for requests that name no sequence, START (and the
    START flag) on a request's first iteration only, READY on every one, CORRID its id."""
    service, _ = served
    n = grpcclient.InferInput("N", [1, 1], "INT32")
    n.set_data_from_numpy(np.array([[1]], np.int32))
    with grpcclient.InferenceServerClient(service.grpc_url) as client:
        results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("controls", [n], request_id="a")
        client.async_stream_infer("controls", [n], request_id="b")
        seen: dict[str, list[list[int]]] = {"a": [], "b": []}
        finals = 0
        while finals < 2:
            result, error = results.get(timeout=60)
            assert error is None, error
            seen[result.get_response().id].append(result.as_numpy("OUT").reshape(-1).tolist())
            finals += result.get_response().parameters["triton_final_response"].bool_param
        client.stop_stream()
    ids = sorted(rows[0][2] for rows in seen.values())
    assert ids == [1, 2]
    for rows in seen.values():
        corrid = rows[0][2]
        assert rows == [
            [1, 1, corrid, 1, corrid],
            [0, 1, corrid, 0, corrid],
            [0, 1, corrid, 0, corrid],
        ]
