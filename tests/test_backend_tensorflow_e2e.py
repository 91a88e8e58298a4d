"""TensorFlow SavedModels, built here with Keras, served by `sluice serve` (a gateway and a
worker over Redis) beside an ONNX and a TorchScript model, and driven with tritonclient:
configs with and without inputs, batching of concurrent requests, results equal to Keras's
own, and configs that contradict the signature."""

from __future__ import annotations

import warnings
from pathlib import Path

import keras
import numpy as np
import onnxruntime as ort
import pytest
import torch
import tritonclient.http as httpclient

from tests.backend_models import http_inputs, run_counts, serving_fixtures
from tests.test_backend_onnxruntime import linear_graph
from tests.test_backend_onnxruntime import write_model as write_onnx
from tests.test_backend_tensorflow import LINEAR_CONFIG, linear_model, write_model

#: eight requests of one row fill the preferred batch: the batcher then runs them at once.
BATCHED = """
max_batch_size: 8
dynamic_batching { preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 5000000 }
"""
TORCH_CONFIG = """
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def _torch_linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2).eval()


@pytest.fixture(scope="module")
def linear() -> keras.Model:
    return linear_model()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, linear: keras.Model) -> Path:
    repo = tmp_path_factory.mktemp("tensorflow") / "models"
    write_model(repo, "bare", linear)
    write_model(repo, "batched", linear, BATCHED)
    write_model(repo, "declared", linear, LINEAR_CONFIG)
    write_model(
        repo,
        "broken",
        linear,
        LINEAR_CONFIG.replace("TYPE_FP32 dims: [ 4 ]", "TYPE_INT32 dims: [ 4 ]"),
    )
    write_model(repo, "misnamed", linear, LINEAR_CONFIG.replace('name: "x"', 'name: "input"'))
    write_onnx(repo, "onnx_linear", linear_graph())
    (repo / "torch_linear" / "1").mkdir(parents=True)
    (repo / "torch_linear" / "config.pbtxt").write_text(TORCH_CONFIG)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit: what model.pt is
        traced = torch.jit.trace(_torch_linear(), torch.zeros(1, 4))
    traced.save(str(repo / "torch_linear" / "1" / "model.pt"))
    return repo


_service, _client = serving_fixtures()


def test_a_config_without_tensors_is_served_completed(
    client: httpclient.InferenceServerClient, linear: keras.Model
) -> None:
    """The config the server reports is Triton's auto-completed one; the answers are Keras's."""
    config = client.get_model_config("bare")
    assert (config["platform"], config["backend"]) == ("tensorflow_savedmodel", "tensorflow")
    assert config["max_batch_size"] == 4
    assert "dynamic_batching" in config
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("x", "TYPE_FP32", [4])
    ]
    assert [(o["name"], o["dims"], o.get("reshape")) for o in config["output"]] == [
        ("label", [1], {"shape": []}),
        ("y", [3], None),
    ]
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    result = client.infer("bare", http_inputs(x=x))
    expected = linear(x)
    np.testing.assert_array_equal(result.as_numpy("y"), expected["y"])
    np.testing.assert_array_equal(result.as_numpy("label"), np.reshape(expected["label"], (3, 1)))


def test_concurrent_requests_run_as_one_batch(
    client: httpclient.InferenceServerClient, linear: keras.Model
) -> None:
    """Eight requests sent together are stacked into batches (fewer runs than requests), and
    each gets exactly its own row of Keras's answer."""
    rows = np.random.default_rng(2).standard_normal((8, 1, 4)).astype(np.float32)
    before = run_counts(client, "batched")
    pending = [client.async_infer("batched", http_inputs(x=x)) for x in rows]
    results = [p.get_result() for p in pending]
    expected = linear(rows.reshape(8, 4))
    for i, result in enumerate(results):
        np.testing.assert_allclose(result.as_numpy("y"), expected["y"][i : i + 1], rtol=1e-6)
        assert result.as_numpy("label").tolist() == [[int(expected["label"][i])]]
    inferences, executions = (
        n - m for n, m in zip(run_counts(client, "batched"), before, strict=True)
    )
    assert inferences == 8
    assert executions < inferences


def test_configs_that_contradict_the_signature_are_unavailable_with_tritons_reason(
    client: httpclient.InferenceServerClient,
) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["broken"]["state"] == "UNAVAILABLE"
    assert index["broken"]["reason"] == (
        "unable to load model 'broken', configuration expects datatype TYPE_INT32 for input "
        "'x', model provides TYPE_FP32"
    )
    assert index["misnamed"]["state"] == "UNAVAILABLE"
    assert index["misnamed"]["reason"] == (
        "unexpected inference input 'input', allowed inputs are: x"
    )


def test_one_worker_serves_tensorflow_onnx_and_torchscript_together(
    client: httpclient.InferenceServerClient, linear: keras.Model, repo: Path
) -> None:
    """Requests to the three frameworks' models, sent at once, each get their own model's
    answer from the same worker."""
    index = {m["name"]: m["state"] for m in client.get_model_repository_index()}
    assert {index[m] for m in ("declared", "onnx_linear", "torch_linear")} == {"READY"}
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    pending = {
        "declared": client.async_infer("declared", http_inputs(x=x)),
        "onnx_linear": client.async_infer("onnx_linear", http_inputs(x=x)),
        "torch_linear": client.async_infer("torch_linear", http_inputs(INPUT__0=x)),
    }
    results = {name: request.get_result() for name, request in pending.items()}
    np.testing.assert_array_equal(results["declared"].as_numpy("y"), linear(x)["y"])
    session = ort.InferenceSession(str(repo / "onnx_linear" / "1" / "model.onnx"))
    (onnx_y,) = session.run(["y"], {"x": x})
    np.testing.assert_array_equal(results["onnx_linear"].as_numpy("y"), onnx_y)
    with torch.no_grad():
        expected = _torch_linear()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(results["torch_linear"].as_numpy("OUTPUT__0"), expected, rtol=1e-6)
