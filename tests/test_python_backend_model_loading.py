"""Triton's model loading API from a Python model (`pb_utils.load_model`, `unload_model`):
the same fleet-wide desired state as the repository API, in explicit mode only, with
Triton's errors; served by `sluice serve` and driven with tritonclient.http."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from sluice.shared.redis_client import sync_client
from tritonclient.utils import InferenceServerException

from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import (
    HERE,
    Service,
    serving_alone,
    start_sluice,
    stop_service,
    wait_until,
)
from tests.redis_cluster import EmbeddedCluster

MODELS = HERE / "triton_python_repo"
NOT_EXPLICIT = (
    "Failed to load model: Failed to process the request for model 'model_control_0', "
    "message: explicit model load / unload is not allowed if polling is enabled"
)


_FP32, _INT32 = {"data_type": "TYPE_FP32", "dims": [4]}, {"data_type": "TYPE_INT32", "dims": [1]}
#: add_sub's config, with batches of two at most.
ADD_SUB_BY_TWO = json.dumps(
    {
        "backend": "python",
        "max_batch_size": 2,
        "input": [{"name": "INPUT0", **_FP32}, {"name": "INPUT1", **_FP32}],
        "output": [
            {"name": "OUTPUT0", **_FP32},
            {"name": "OUTPUT1", **_FP32},
            {"name": "REQUESTS", **_INT32},
        ],
    }
)


#: an ensemble whose one step is add_sub.
ENSEMBLE = """
name: "add_sub_ens"
platform: "ensemble"
max_batch_size: 8
input [
  { name: "A", data_type: TYPE_FP32, dims: [ 4 ] },
  { name: "B", data_type: TYPE_FP32, dims: [ 4 ] }
]
output [ { name: "SUM", data_type: TYPE_FP32, dims: [ 4 ] } ]
ensemble_scheduling { step [ {
  model_name: "add_sub" model_version: -1
  input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
  output_map { key: "OUTPUT0" value: "SUM" }
} ] }
"""


@pytest.fixture(scope="module")
def explicit(
    scratch_redis: EmbeddedRedis | EmbeddedCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """`sluice serve` in explicit mode with only model_control loaded at start."""
    client = sync_client(scratch_redis.url)
    client.flushall()
    client.close()
    repo = tmp_path_factory.mktemp("loading") / "models"
    for model in ("model_control", "add_sub"):
        shutil.copytree(MODELS / model, repo / model)
    broken = repo / "broken"
    shutil.copytree(MODELS / "add_sub", broken)
    config = (broken / "config.pbtxt").read_text().replace('"add_sub"', '"broken"')
    (broken / "config.pbtxt").write_text(config.replace("max_batch_size: 8", "max_batch_size: -8"))
    (repo / "add_sub_ens" / "1").mkdir(parents=True)
    (repo / "add_sub_ens" / "config.pbtxt").write_text(ENSEMBLE)
    args = ["--model-repository", str(repo), "--redis-url", scratch_redis.url, "--grpc-port", "0"]
    mode = ["--model-control-mode", "explicit", "--load-model", "model_control"]
    service = start_sluice("serve", [*args, *mode])
    yield service
    stop_service(service)


@pytest.fixture
def client(explicit: Service) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(explicit.http_url) as connection:
        yield connection


def control(
    client: httpclient.InferenceServerClient, action: str, target: str, config: str = ""
) -> str:
    """What model_control answers for `action` on `target`."""
    inputs = []
    for name, text in (("ACTION", action), ("TARGET", target), ("CONFIG", config)):
        tensor = httpclient.InferInput(name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        inputs.append(tensor)
    result = client.infer("model_control", inputs).as_numpy("RESULT")
    return str(result[0].decode())


def test_a_model_loads_and_unloads_another_fleet_wide(
    client: httpclient.InferenceServerClient,
) -> None:
    assert not client.is_model_ready("add_sub")
    assert control(client, "load", "add_sub") == "ok"  # returns once it is ready
    assert client.is_model_ready("add_sub")
    assert control(client, "ready", "add_sub") == "True"
    assert control(client, "unload", "add_sub") == "ok"  # returns at once, as Triton's
    wait_until(lambda: not client.is_model_ready("add_sub"), "the unload seen by the gateway")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    wait_until(
        lambda: (
            {m["name"]: m for m in client.get_model_repository_index()}["add_sub"].get("reason")
            == "unloaded"
        ),
        "the workers' unload",
    )
    assert index["model_control"]["state"] == "READY"


def test_readiness_read_before_a_load_is_not_kept_past_it(
    client: httpclient.InferenceServerClient,
) -> None:
    """As Triton's model loading example does: not ready, so load it; ready right after."""
    assert control(client, "ready_load_ready", "add_sub") == "False->True"
    assert control(client, "unload", "add_sub") == "ok"
    assert control(client, "ready", "add_sub") == "False"


def test_a_load_with_a_config_override_serves_that_config(
    client: httpclient.InferenceServerClient,
) -> None:
    config = ADD_SUB_BY_TWO
    assert control(client, "load", "add_sub", config) == "ok"
    # the gateways take the new config from the workers' records (within a heartbeat)
    wait_until(
        lambda: (
            client.is_model_ready("add_sub")
            and client.get_model_config("add_sub")["max_batch_size"] == 2
        ),
        "the override served",
    )
    assert control(client, "unload", "add_sub") == "ok"


def test_a_load_with_files_serves_a_model_no_repository_holds(
    client: httpclient.InferenceServerClient,
) -> None:
    assert control(client, "load_files", "fresh", ADD_SUB_BY_TWO) == "ok"
    wait_until(lambda: client.is_model_ready("fresh"), "the gateway serving it")
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = httpclient.InferInput(name, [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        inputs.append(tensor)
    assert client.infer("fresh", inputs).as_numpy("OUTPUT0").tolist() == [[2.0] * 4]
    assert control(client, "unload", "fresh") == "ok"


def test_loading_an_ensemble_loads_its_steps_and_unloading_its_dependents_them(
    client: httpclient.InferenceServerClient,
) -> None:
    """As Triton's load of an ensemble: its composing models not ready are loaded with it."""
    assert control(client, "load", "add_sub_ens") == "ok"
    assert control(client, "ready", "add_sub") == "True"
    assert control(client, "unload_dependents", "add_sub_ens") == "ok"
    assert control(client, "ready", "add_sub") == "False"


def test_failed_loads_raise_tritons_errors(client: httpclient.InferenceServerClient) -> None:
    prefix = "Failed to load model: Failed to process the request for model 'model_control_0', "
    assert control(client, "load", "nowhere") == (
        prefix + "message: failed to load 'nowhere', failed to poll from model repository"
    )
    broken = control(client, "load", "broken")
    with pytest.raises(InferenceServerException) as refused:  # the repository API's own answer
        client.load_model("broken")
    assert broken == prefix + "message: " + refused.value.message()
    assert control(client, "load", "add_sub", "[1]") == (
        prefix + "message: failed to load 'add_sub', failed to poll from model repository"
    )


def test_outside_explicit_mode_the_api_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    for model in ("model_control", "add_sub"):
        shutil.copytree(MODELS / model, repo / model)
    with (
        serving_alone(repo) as service,
        httpclient.InferenceServerClient(service.http_url) as connection,
    ):
        assert control(connection, "load", "add_sub") == NOT_EXPLICIT
        unloaded = control(connection, "unload", "add_sub")
        assert unloaded == NOT_EXPLICIT.replace("Failed to load", "Failed to unload")
        assert connection.is_model_ready("add_sub")
