"""ONNX models, built here with the onnx package, served by `sluice serve` (a gateway and a
worker over Redis) and driven with tritonclient: configs with and without inputs, batching of
concurrent requests, strings, a broken model beside good ones, and a worker without
onnxruntime."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.backend_models import http_inputs, run_counts, serving_fixtures
from tests.conftest import HERE, Service, start_service, stop_service
from tests.test_backend_onnxruntime import (
    LINEAR_CONFIG,
    add_sub_graph,
    linear_graph,
    strings_graph,
    write_model,
)

#: eight requests of one row fill the preferred batch: the batcher then runs them at once.
BATCHED = """
max_batch_size: 8
dynamic_batching { preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 5000000 }
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("onnx") / "models"
    write_model(repo, "bare", linear_graph())
    write_model(repo, "batched", linear_graph(), BATCHED)
    write_model(repo, "declared", linear_graph(), LINEAR_CONFIG)
    write_model(repo, "add_sub", add_sub_graph(), directory=True)
    write_model(repo, "strings", strings_graph())
    write_model(repo, "broken", linear_graph(), LINEAR_CONFIG.replace("TYPE_FP32", "TYPE_FP16"))
    return repo


_service, _client = serving_fixtures()


def _ort_run(repo: Path, model: str, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    path = repo / model / "1" / "model.onnx"
    path = path / "model.onnx" if path.is_dir() else path
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feed), strict=True))


def test_a_config_without_tensors_is_served_completed(
    client: httpclient.InferenceServerClient, repo: Path
) -> None:
    """The model's config, as the server reports it, is Triton's auto-completed one."""
    config = client.get_model_config("bare")
    assert config["max_batch_size"] == 4
    assert "dynamic_batching" in config
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("x", "TYPE_FP32", [4])
    ]
    assert [(o["name"], o["dims"], o.get("reshape")) for o in config["output"]] == [
        ("y", [3], None),
        ("label", [1], {"shape": []}),
    ]
    metadata = client.get_model_metadata("bare")
    assert [(o["name"], o["shape"]) for o in metadata["outputs"]] == [
        ("y", [-1, 3]),
        ("label", [-1, 1]),
    ]
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    result = client.infer("bare", http_inputs(x=x))
    expected = _ort_run(repo, "bare", {"x": x})
    np.testing.assert_array_equal(result.as_numpy("y"), expected["y"])
    np.testing.assert_array_equal(result.as_numpy("label"), expected["label"].reshape(3, 1))


def test_concurrent_requests_run_as_one_batch(
    client: httpclient.InferenceServerClient, repo: Path
) -> None:
    """Eight requests sent together are stacked into batches (fewer runs than requests), and
    each gets exactly its own rows of onnxruntime's answer."""
    rows = np.random.default_rng(2).standard_normal((8, 1, 4)).astype(np.float32)
    before = run_counts(client, "batched")
    pending = [client.async_infer("batched", http_inputs(x=x)) for x in rows]
    results = [p.get_result() for p in pending]
    expected = _ort_run(repo, "batched", {"x": rows.reshape(8, 4)})
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.as_numpy("y"), expected["y"][i : i + 1])
        assert result.as_numpy("label").tolist() == [[expected["label"][i]]]
    inferences, executions = (
        n - m for n, m in zip(run_counts(client, "batched"), before, strict=True)
    )
    assert inferences == 8
    assert executions < inferences


def test_requests_of_several_rows_and_two_inputs(
    client: httpclient.InferenceServerClient, repo: Path
) -> None:
    """A model in a `model.onnx` directory, two inputs, requests of 1 to 3 rows at once."""
    rng = np.random.default_rng(3)
    cases = [rng.standard_normal((2, n, 2)).astype(np.float32) for n in (1, 2, 3)]
    pending = [client.async_infer("add_sub", http_inputs(a=a, b=b)) for a, b in cases]
    for (a, b), request in zip(cases, pending, strict=True):
        result = request.get_result()
        np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
        np.testing.assert_array_equal(result.as_numpy("diff"), a - b)


def test_strings_round_trip(client: httpclient.InferenceServerClient) -> None:
    text = np.array([[b"hello"], ["wörld".encode()]], dtype=np.object_)
    result = client.infer("strings", http_inputs(text=text))
    assert result.as_numpy("echo").tolist() == [[b"hello"], ["wörld".encode()]]


def test_a_declared_config_over_grpc(service: Service, repo: Path) -> None:
    x = np.random.default_rng(4).standard_normal((2, 4)).astype(np.float32)
    with grpcclient.InferenceServerClient(service.grpc_url) as client:
        tensor = grpcclient.InferInput("x", [2, 4], "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer("declared", [tensor])
    np.testing.assert_array_equal(result.as_numpy("y"), _ort_run(repo, "declared", {"x": x})["y"])


def test_a_config_that_contradicts_the_graph_is_unavailable_with_tritons_reason(
    client: httpclient.InferenceServerClient,
) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["broken"]["state"] == "UNAVAILABLE"
    assert index["broken"]["reason"] == (
        "unable to load model 'broken', configuration expects datatype TYPE_FP16 for input "
        "'x', model provides TYPE_FP32"
    )
    assert index["declared"]["state"] == "READY"


def test_without_onnxruntime_onnx_models_are_unavailable_naming_the_extra(
    repo: Path, redis_url: str, tmp_path: Path
) -> None:
    """A worker whose Python cannot import onnxruntime (the [onnx] extra) serves its other
    models; every ONNX model, auto-completed or declared, says what to install."""
    models = tmp_path / "models"
    for name in ("bare", "declared"):
        shutil.copytree(repo / name, models / name)
    shutil.copytree(HERE / "triton_python_repo" / "add_sub", models / "add_sub")
    hide = tmp_path / "hide"
    hide.mkdir()
    # sitecustomize runs at every interpreter's start: onnxruntime cannot be found or imported
    (hide / "sitecustomize.py").write_text('import sys\nsys.modules["onnxruntime"] = None\n')
    svc = start_service(
        ["--model-repository", str(models), "--redis-url", redis_url],
        env={"PYTHONPATH": str(hide)},
    )
    try:
        with httpclient.InferenceServerClient(svc.http_url) as client:
            index = {m["name"]: m for m in client.get_model_repository_index()}
            ones = np.ones((1, 4), np.float32)
            summed = client.infer("add_sub", http_inputs(INPUT0=ones, INPUT1=ones)).as_numpy(
                "OUTPUT0"
            )
    finally:
        stop_service(svc)
    assert summed.tolist() == [[2.0] * 4]
    for name in ("bare", "declared"):
        assert index[name]["state"] == "UNAVAILABLE"
        assert index[name]["reason"] == (
            f"model '{name}' needs the onnxruntime package: pip install 'sluice-serve[onnx]'"
        )
