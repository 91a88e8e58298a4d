"""Explicit model control of an ensemble, as Triton: loading it loads its composing models
(nested ensembles' too), and unloading it with `unload_dependents` unloads them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import Service, _redis, start_service, stop_service, wait_until
from tests.ensemble_repo import ensemble, python_model


@pytest.fixture(scope="module")
def explicit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """inc (x+1), add (a+b); plus = inc(IN) + IN; outer = plus -> inc; nothing loaded at start."""
    root = tmp_path_factory.mktemp("ensembles")
    python_model(root, "inc", ["X"], ["Y"], "X + 1")
    python_model(root, "add", ["A", "B"], ["SUM"], "A + B")
    plus_steps = [("inc", {"X": "IN"}, {"Y": "l"}), ("add", {"A": "l", "B": "IN"}, {"SUM": "OUT"})]
    ensemble(root, "plus", ["IN"], ["OUT"], plus_steps)
    outer_steps = [("plus", {"IN": "IN"}, {"OUT": "m"}), ("inc", {"X": "m"}, {"Y": "OUT"})]
    ensemble(root, "outer", ["IN"], ["OUT"], outer_steps)
    with _redis() as server:
        args = ["--model-repository", str(root), "--redis-url", server.url]
        service = start_service([*args, "--model-control-mode", "explicit", "--bulk-workers", "0"])
        try:
            yield service
        finally:
            stop_service(service)


def _states(client: httpclient.InferenceServerClient) -> dict[str, str]:
    return {e["name"]: e.get("state", "") for e in client.get_model_repository_index()}


def _infer(client: httpclient.InferenceServerClient, model: str) -> list[float]:
    tensor = httpclient.InferInput("IN", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[2.0]], np.float32))
    return list(client.infer(model, [tensor]).as_numpy("OUT").ravel())


def test_loading_an_ensemble_loads_its_steps_and_unload_dependents_unloads_them(
    explicit: Service,
) -> None:
    client = httpclient.InferenceServerClient(explicit.http_url, network_timeout=120)
    try:
        assert _states(client) == {"add": "", "inc": "", "outer": "", "plus": ""}
        client.load_model("outer")  # outer -> plus -> inc, add
        assert _states(client) == dict.fromkeys(("add", "inc", "outer", "plus"), "READY")
        assert _infer(client, "outer") == [2.0 + 1 + 2 + 1]

        client.unload_model("outer")  # its steps stay
        wait_until(lambda: _states(client)["outer"] == "UNAVAILABLE", "outer unloaded")
        assert _states(client) == {
            **dict.fromkeys(("add", "inc", "plus"), "READY"),
            "outer": "UNAVAILABLE",
        }

        client.load_model("outer")
        assert _infer(client, "outer") == [2.0 + 1 + 2 + 1]
        client.unload_model("outer", unload_dependents=True)
        unloaded = {"add", "inc", "outer", "plus"}
        wait_until(
            lambda: {m for m, s in _states(client).items() if s == "UNAVAILABLE"} == unloaded,
            "outer and its steps unloaded",
        )
    finally:
        client.close()
