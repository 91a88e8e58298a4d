"""What the backend tests share: a model directory loaded as the worker loads it (config
auto-completed, then one instance), the error a bad one fails with, binary HTTP inputs, and a
script run in a fresh process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import ModelSpec, load_model_config
from sluice.workers.backends import choose_device, complete_config, load_function
from tritonclient.utils import np_to_triton_dtype

from tests.conftest import Service, serving_alone

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`script` run by a fresh interpreter in the repository root, as a worker process of its
    own would (none of this test process's loaded runtimes or threads), its output captured."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def model_spec(model_dir: Path) -> ModelSpec:
    return load_model_config(model_dir, complete=complete_config)


def model_instance(model_dir: Path) -> Any:
    """Version 1's first instance, on the device the worker would pick."""
    spec = model_spec(model_dir)
    return load_function(spec, model_dir, 1, choose_device(spec), 0)


def load_error(model_dir: Path) -> str:
    """The message of the ModelConfigError that loading the model fails with."""
    with pytest.raises(ModelConfigError) as err:
        model_instance(model_dir)
    return err.value.message


def http_inputs(**arrays: np.ndarray) -> list[httpclient.InferInput]:
    """Binary HTTP inputs named as the keywords, typed after the arrays."""
    inputs = []
    for name, array in arrays.items():
        tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    return inputs


def run_counts(client: httpclient.InferenceServerClient, model: str) -> tuple[int, int]:
    """The model's inference and execution counts so far (Triton's statistics): fewer
    executions than inferences mean requests ran batched."""
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))


def serving_fixtures() -> tuple[Any, Any]:
    """A module's `service` (`sluice serve` on the module's own `repo` fixture, with a Redis of
    its own) and `client` (eight connections to it, for requests sent at once) fixtures:
    assign the pair to module names."""

    @pytest.fixture(scope="module", name="service")
    def service(repo: Path) -> Iterator[Service]:
        with serving_alone(repo) as served:
            yield served

    @pytest.fixture(scope="module", name="client")
    def client(service: Service) -> Iterator[httpclient.InferenceServerClient]:
        with httpclient.InferenceServerClient(service.http_url, concurrency=8) as connections:
            yield connections

    return service, client
