"""OpenVINO models, converted here from ONNX graphs built with the onnx package, served by
`sluice serve` (a gateway and a worker over Redis) and driven with tritonclient: configs with
and without inputs, batching of concurrent requests, a broken model beside good ones, and a
TensorRT plan that this GPU-less machine cannot serve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.backend_models import http_inputs, run_counts, serving_fixtures
from tests.conftest import Service
from tests.test_backend_openvino import DENSE_CONFIG, dense_graph, numpy_dense, write_model

#: eight requests of one row fill the preferred batch: the batcher then runs them at once.
BATCHED = """
max_batch_size: 8
dynamic_batching { preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 5000000 }
"""
TENSORRT_REASON = (
    "model 'engine' needs an NVIDIA GPU and the tensorrt package "
    "(pip install 'sluice-serve[tensorrt]'): no CUDA device is present"
)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("openvino") / "models"
    write_model(repo, "bare", dense_graph(), layout="N...")
    write_model(repo, "batched", dense_graph(), BATCHED)
    write_model(repo, "declared", dense_graph(), DENSE_CONFIG)
    write_model(repo, "onnx", dense_graph(), DENSE_CONFIG, as_onnx=True)
    write_model(repo, "broken", dense_graph(), DENSE_CONFIG.replace('"x"', '"z"'))
    engine = repo / "engine"
    (engine / "1").mkdir(parents=True)
    (engine / "1" / "model.plan").write_bytes(b"any bytes: no GPU reads them here")
    (engine / "config.pbtxt").write_text('platform: "tensorrt_plan"\n' + DENSE_CONFIG)
    return repo


_service, _client = serving_fixtures()


def test_a_config_without_tensors_is_served_completed(
    client: httpclient.InferenceServerClient,
) -> None:
    """The model's config, as the server reports it, is Triton's auto-completed one."""
    config = client.get_model_config("bare")
    assert config["max_batch_size"] == 4
    assert "dynamic_batching" in config
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [
        ("x", "TYPE_FP32", [4])
    ]
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [
        ("y", "TYPE_FP32", [3]),
        ("top", "TYPE_INT64", [1]),
    ]
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    result = client.infer("bare", http_inputs(x=x))
    expected = numpy_dense(x)
    np.testing.assert_allclose(result.as_numpy("y"), expected["y"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("top"), expected["top"])


def test_concurrent_requests_run_as_one_batch(client: httpclient.InferenceServerClient) -> None:
    """Eight requests sent together are stacked into batches (fewer runs than requests), and
    each gets exactly its own rows of the answer."""
    rows = np.random.default_rng(2).standard_normal((8, 1, 4)).astype(np.float32)
    inferences, executions = run_counts(client, "batched")
    pending = [client.async_infer("batched", http_inputs(x=x)) for x in rows]
    results = [p.get_result() for p in pending]
    expected = numpy_dense(rows.reshape(8, 4))
    for i, result in enumerate(results):
        np.testing.assert_allclose(
            result.as_numpy("y"), expected["y"][i : i + 1], rtol=1e-6, atol=1e-6
        )
        assert result.as_numpy("top").tolist() == [expected["top"][i].tolist()]
    inferences_after, executions_after = run_counts(client, "batched")
    assert inferences_after - inferences == 8
    assert executions_after - executions < 8


def test_an_onnx_file_and_a_declared_config_over_grpc(service: Service) -> None:
    x = np.random.default_rng(4).standard_normal((2, 4)).astype(np.float32)
    with grpcclient.InferenceServerClient(service.grpc_url) as client:
        for model in ("declared", "onnx"):
            tensor = grpcclient.InferInput("x", [2, 4], "FP32")
            tensor.set_data_from_numpy(x)
            result = client.infer(model, [tensor])
            np.testing.assert_allclose(
                result.as_numpy("y"), numpy_dense(x)["y"], rtol=1e-6, atol=1e-6
            )


def test_a_config_that_contradicts_the_model_is_unavailable_with_tritons_reason(
    client: httpclient.InferenceServerClient,
) -> None:
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["broken"]["state"] == "UNAVAILABLE"
    assert index["broken"]["reason"] == "unexpected inference input 'z', allowed inputs are: x"
    assert index["declared"]["state"] == "READY"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_a_tensorrt_plan_without_a_gpu_is_unavailable_and_the_rest_serves(
    client: httpclient.InferenceServerClient,
) -> None:
    """The repository index gives the reason, and so does asking for the model."""
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert (index["engine"]["state"], index["engine"]["reason"]) == ("UNAVAILABLE", TENSORRT_REASON)
    assert not client.is_model_ready("engine")
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("engine")
    assert TENSORRT_REASON in str(err.value)
    assert {name for name, m in index.items() if m["state"] == "READY"} == {
        "bare",
        "batched",
        "declared",
        "onnx",
    }
