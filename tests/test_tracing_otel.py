"""Triton's trace extension in OpenTelemetry mode: the settings as tritonserver 2.51 shows them,
the trace context on the wire, and a fleet of two gateways and two workers whose spans of one
request (an ensemble's, a BLS call's) make one trace in an OTLP receiver on loopback."""

from __future__ import annotations

import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
from sluice.shared.trace_settings import parse_trace_config

from tests.conftest import start_sluice, stop_service
from tests.ensemble_repo import ensemble, python_model
from tests.otlp_receiver import OtlpReceiver, Span

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
WORKER_SPANS = {"queue", "batch", "compute", "publish"}
COMPUTE = ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]


def test_opentelemetry_settings_show_as_tritonserver_shows_them() -> None:
    settings = parse_trace_config(
        [
            "mode=opentelemetry",
            "opentelemetry,url=127.0.0.1:14318/v1/traces",
            "level=TIMESTAMPS",
            "rate=1",
            "opentelemetry,bsp_schedule_delay=200",
            "opentelemetry,resource=deployment=test",
        ]
    )
    # tritonserver 2.51's answer to GET /v2/trace/setting with these flags, key order included
    shown = settings.to_json()
    assert list(shown.items()) == [
        ("trace_level", ["TIMESTAMPS"]),
        ("trace_rate", "1"),
        ("trace_count", "-1"),
        ("trace_mode", "opentelemetry"),
        ("url", "127.0.0.1:14318/v1/traces"),
        ("bsp_schedule_delay", "200"),
        ("resource", "deployment=test"),
        ("bsp_max_export_batch_size", "512"),
        ("bsp_max_queue_size", "2048"),
    ]
    # no file is needed in this mode
    assert parse_trace_config(["mode=opentelemetry", "level=TIMESTAMPS"]).on


def _repository(root: Path) -> Path:
    python_model(root, "double", ["x"], ["y"], "x * 2")
    python_model(root, "plus_one", ["y"], ["z"], "y + 1")
    ensemble(
        root,
        "pipeline",
        ["x"],
        ["z"],
        [("double", {"x": "x"}, {"y": "mid"}), ("plus_one", {"y": "mid"}, {"z": "z"})],
    )
    (root / "caller" / "1").mkdir(parents=True)
    (root / "caller" / "config.pbtxt").write_text(
        'name: "caller"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "x", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "y", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
    )
    (root / "caller" / "1" / "model.py").write_text(
        textwrap.dedent(
            """
            import triton_python_backend_utils as pb_utils


            class TritonPythonModel:
                def execute(self, requests):
                    responses = []
                    for request in requests:
                        x = pb_utils.get_input_tensor_by_name(request, "x")
                        call = pb_utils.InferenceRequest(
                            model_name="double",
                            inputs=[x],
                            requested_output_names=["y"],
                            trace=request.trace(),
                        )
                        y = call.exec().output_tensors()[0]
                        responses.append(pb_utils.InferenceResponse([y]))
                    return responses
            """
        )
    )
    return root


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


def _infer(address: str, model: str, value: float, traceparent: str | None = None) -> list[float]:
    name = "x"
    body = {"inputs": [{"name": name, "datatype": "FP32", "shape": [1, 1], "data": [value]}]}
    headers = {"traceparent": traceparent} if traceparent else {}
    request = urllib.request.Request(
        f"http://{address}/v2/models/{model}/infer", orjson.dumps(body), headers
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return list(orjson.loads(response.read())["outputs"][0]["data"])


def _children(spans: list[Span], parent: Span) -> dict[str, list[Span]]:
    found: dict[str, list[Span]] = {}
    for span in spans:
        if span.parent_id == parent.span_id:
            found.setdefault(span.name, []).append(span)
    return found


def _one(spans: list[Span], name: str) -> Span:
    (span,) = [s for s in spans if s.name == name]
    return span


def _worker_spans_under(spans: list[Span], parent: Span) -> None:
    """The worker's spans of one request, under `parent`, and what they say."""
    below = _children(spans, parent)
    assert set(below) >= WORKER_SPANS, below.keys()
    for name in WORKER_SPANS:
        (span,) = below[name]
        assert span.resource["sluice.role"] == "worker"
        assert span.trace_id == parent.trace_id
        assert span.start_ns <= span.end_ns
    (batch,) = below["batch"]
    assert batch.attributes["sluice.batch.size"] >= 1
    assert (
        len(batch.attributes["sluice.batch.request_ids"])
        == batch.attributes["sluice.batch.requests"]
    )
    (compute,) = below["compute"]
    assert compute.events == COMPUTE
    (queue,) = below["queue"]
    assert queue.end_ns <= batch.start_ns + 1 and compute.end_ns <= batch.end_ns


def test_a_fleets_spans_of_one_request_make_one_trace(
    tmp_path: Path, redis_url: str, receiver: OtlpReceiver
) -> None:
    repo = _repository(tmp_path / "models")
    tracing = [
        *("--trace-config", "mode=opentelemetry"),
        *("--trace-config", f"opentelemetry,url={receiver.url}"),
        *("--trace-config", "opentelemetry,bsp_schedule_delay=50"),
        *("--trace-config", "opentelemetry,resource=deployment=test"),
        *("--trace-config", "level=TIMESTAMPS"),
        *("--trace-config", "rate=0"),  # only the requests whose client sends a context
    ]
    common = ["--model-repository", str(repo), "--redis-url", redis_url]
    serve = start_sluice("serve", [*common, "--workers", "2", *tracing])
    other = start_sluice("gateway", ["--redis-url", redis_url, *tracing])
    try:
        assert _infer(other.http_url, "pipeline", 1.0) == [3.0]  # not traced: rate 0
        context = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
        assert _infer(other.http_url, "pipeline", 2.0, context) == [5.0]
        bls_trace = "1" * 32
        assert _infer(serve.http_url, "caller", 4.0, f"00-{bls_trace}-{'2' * 16}-01") == [8.0]
        grpc_trace = "3" * 32
        with grpcclient.InferenceServerClient(other.grpc_url) as client:
            x = grpcclient.InferInput("x", [1, 1], "FP32")
            x.set_data_from_numpy(np.array([[5.0]], np.float32))
            headers = {"traceparent": f"00-{grpc_trace}-{'4' * 16}-01"}
            answer = client.infer("double", [x], headers=headers).as_numpy("y")
            assert answer.tolist() == [[10.0]]
        generated = "5" * 32
        request = urllib.request.Request(
            f"http://{serve.http_url}/v2/models/double/generate",
            b'{"x": [6.0]}',
            {"traceparent": f"00-{generated}-{'6' * 16}-01"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert orjson.loads(response.read())["y"] == 12.0

        # each process exports on its own: a trace is whole once its gateway's last span
        # (respond) and its workers' (a publish per model run) are in
        publishes = {CLIENT_TRACE: 2, bls_trace: 2, grpc_trace: 1, generated: 1}

        def complete(spans: list[Span]) -> bool:
            return all(
                [s.name for s in spans if s.trace_id == trace_id].count("publish") == count
                and any(s.name == "respond" and s.trace_id == trace_id for s in spans)
                for trace_id, count in publishes.items()
            )

        everything = receiver.wait_for(complete)
    finally:
        stop_service(other)
        stop_service(serve)
    # nothing else traced
    assert {s.trace_id for s in everything} == {CLIENT_TRACE, bls_trace, grpc_trace, generated}
    for trace_id, parent in ((grpc_trace, "4" * 16), (generated, "6" * 16)):
        spans = [s for s in everything if s.trace_id == trace_id]
        assert _one(spans, "InferRequest").parent_id == parent
        _worker_spans_under(spans, _one(spans, "double"))

    # the ensemble's trace: the client's span is the root's parent
    spans = [s for s in everything if s.trace_id == CLIENT_TRACE]
    root = _one(spans, "InferRequest")
    assert root.parent_id == CLIENT_SPAN and root.resource["sluice.role"] == "gateway"
    assert root.resource["service.name"] == "triton-inference-server"
    assert root.resource["deployment"] == "test"
    assert "INFER_RESPONSE_COMPLETE" in root.events
    below_root = _children(spans, root)
    assert set(below_root) == {"pipeline", "respond"}
    (model,) = below_root["pipeline"]
    assert model.attributes["triton.model_name"] == "pipeline"
    assert model.attributes["triton.model_version"] == 1
    assert model.events == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    below_model = _children(spans, model)
    assert {"decode", "validate", "reply read", "double", "plus_one"} <= set(below_model)
    for step in ("double", "plus_one"):
        (step_span,) = below_model[step]
        assert step_span.attributes["triton.model_name"] == step
        assert step_span.resource["sluice.role"] == "worker"
        assert step_span.events == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
        _worker_spans_under(spans, step_span)
    first, second = below_model["double"][0], below_model["plus_one"][0]
    assert first.end_ns <= second.end_ns

    # the BLS call's trace: the called model's span under the caller's, as Triton nests it
    spans = [s for s in everything if s.trace_id == bls_trace]
    caller = _one(spans, "caller")
    assert caller.parent_id == _one(spans, "InferRequest").span_id
    _worker_spans_under(spans, caller)
    called = _one(spans, "double")
    assert called.parent_id == caller.span_id
    _worker_spans_under(spans, called)
