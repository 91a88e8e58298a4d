"""Ensembles served end to end: chain, DAG, nested, errors and invalid ensembles."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Service, wait_until
from tests.ensemble_repo import build, serving


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    repo = build(tmp_path_factory.mktemp("ensembles"))
    with serving(repo, "nested") as svc:
        yield svc


def infer(
    client: httpclient.InferenceServerClient, model: str, x: np.ndarray, *outputs: str
) -> dict[str, np.ndarray]:
    given = httpclient.InferInput("IN", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    wanted = [httpclient.InferRequestedOutput(o) for o in outputs] or None
    result = client.infer(model, [given], outputs=wanted)
    names = outputs or tuple(o["name"] for o in result.get_response()["outputs"])
    return {n: result.as_numpy(n) for n in names}


def by_hand(
    client: httpclient.InferenceServerClient, model: str, name: str, out: str, x: np.ndarray
) -> np.ndarray:
    given = httpclient.InferInput(name, list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    return client.infer(model, [given]).as_numpy(out)


EXPECTED = {
    "chain": lambda x: (x + 1) * 2 + 1,
    "dag": lambda x: (x + 1) + 2 * x,
    "joined_input": lambda x: 3 * x,
}


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_ensemble_answers_under_concurrent_load(served: Service, model: str) -> None:
    client = httpclient.InferenceServerClient(served.http_url, concurrency=16)
    rows = [np.array([[float(i)], [float(i) + 0.5]], dtype=np.float32) for i in range(64)]
    pending = []
    for x in rows:
        given = httpclient.InferInput("IN", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        pending.append(client.async_infer(model, [given]))
    for x, call in zip(rows, pending, strict=True):
        np.testing.assert_array_equal(call.get_result().as_numpy("OUT"), EXPECTED[model](x))


def test_chain_equals_its_steps_called_by_hand(served: Service) -> None:
    client = httpclient.InferenceServerClient(served.http_url)
    x = np.array([[3.0], [-2.0]], dtype=np.float32)
    a = by_hand(client, "inc", "X", "Y", x)
    b = by_hand(client, "double", "INPUT__0", "OUTPUT__0", a)
    c = by_hand(client, "inc", "X", "Y", b)
    np.testing.assert_array_equal(infer(client, "chain", x)["OUT"], c)


def test_nested_ensemble_and_requested_outputs(served: Service) -> None:
    client = httpclient.InferenceServerClient(served.http_url)
    x = np.array([[1.0]], dtype=np.float32)
    both = infer(client, "nested", x)
    np.testing.assert_array_equal(both["MID"], [[5.0]])
    np.testing.assert_array_equal(both["OUT"], [[10.0]])
    only = infer(client, "nested", x, "MID")
    assert set(only) == {"MID"}
    np.testing.assert_array_equal(only["MID"], [[5.0]])


@pytest.mark.parametrize("model", ["chain", "dag"])
def test_a_failing_step_answers_at_once(served: Service, model: str) -> None:
    client = httpclient.InferenceServerClient(served.http_url, network_timeout=30)
    with pytest.raises(InferenceServerException) as info:
        infer(client, model, np.array([[-1000.0]], dtype=np.float32))
    assert f"in ensemble '{model}'" in str(info.value)
    assert "refuses values below -100" in str(info.value)
    # the ensemble still serves
    np.testing.assert_array_equal(
        infer(client, "chain", np.array([[0.0]], dtype=np.float32))["OUT"], [[3.0]]
    )


def test_invalid_ensembles_are_unavailable_with_their_reason(served: Service) -> None:
    client = httpclient.InferenceServerClient(served.http_url)
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["broken_model"]["state"] == "UNAVAILABLE"
    assert (
        "contains models that are not available or ambiguous: nowhere"
        in index["broken_model"]["reason"]
    )
    assert index["broken_tensor"]["state"] == "UNAVAILABLE"
    assert "non-existing input NOPE in model inc" in index["broken_tensor"]["reason"]
    assert not client.is_model_ready("broken_model")
    assert client.is_model_ready("chain") and client.is_model_ready("inc")


def test_ensemble_config_and_statistics(served: Service) -> None:
    client = httpclient.InferenceServerClient(served.http_url)
    config = client.get_model_config("chain")
    assert config["platform"] == "ensemble"
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == [
        "inc",
        "double",
        "inc",
    ]
    before = client.get_inference_statistics("chain")["model_stats"][0]["inference_stats"]
    infer(client, "chain", np.array([[1.0]], dtype=np.float32))
    with pytest.raises(InferenceServerException):
        infer(client, "chain", np.array([[-1000.0]], dtype=np.float32))

    def counted() -> bool:
        stats = client.get_inference_statistics("chain")["model_stats"][0]["inference_stats"]
        return (
            stats["success"]["count"] == before["success"]["count"] + 1
            and stats["fail"]["count"] == before["fail"]["count"] + 1
        )

    wait_until(counted, "the ensemble's statistics")


def test_ensemble_over_grpc(served: Service) -> None:
    client = grpcclient.InferenceServerClient(served.grpc_url)
    x = np.array([[2.0], [7.0]], dtype=np.float32)
    given = grpcclient.InferInput("IN", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    result = client.infer("dag", [given])
    np.testing.assert_array_equal(result.as_numpy("OUT"), (x + 1) + 2 * x)
    client.close()
