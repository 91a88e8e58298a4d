"""The example digits_ensemble (Python pre-processing -> digits -> Python post-processing)
served from the example repository's files, against its steps called one after another."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from sklearn.datasets import load_digits

from tests.conftest import Service
from tests.ensemble_repo import serving

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "model_repository"


class StandIn(torch.nn.Module):
    """The digits model's signature with fixed weights (the example's is trained by
    examples/build_models.py, which the tests do not run)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    repo = tmp_path_factory.mktemp("digits")
    for name in ("digits_pre", "digits_post", "digits_ensemble"):
        shutil.copytree(EXAMPLES / name, repo / name)
    (repo / "digits" / "1").mkdir(parents=True)
    for name in ("config.pbtxt", "labels.txt"):
        shutil.copy(EXAMPLES / "digits" / name, repo / "digits" / name)
    torch.jit.script(StandIn()).save(str(repo / "digits" / "1" / "model.pt"))
    with serving(repo, "digits_ensemble") as svc:
        yield svc


def _call(
    client: httpclient.InferenceServerClient,
    model: str,
    name: str,
    x: np.ndarray,
    dtype: str,
    out: str,
) -> np.ndarray:
    given = httpclient.InferInput(name, list(x.shape), dtype)
    given.set_data_from_numpy(x)
    return client.infer(model, [given]).as_numpy(out)


def test_digits_ensemble_equals_its_steps_by_hand(served: Service) -> None:
    client = httpclient.InferenceServerClient(served.http_url)
    pixels = load_digits().images[:24].astype(np.uint8)
    labels = _call(client, "digits_ensemble", "PIXELS", pixels, "UINT8", "LABEL")
    image = _call(client, "digits_pre", "PIXELS", pixels, "UINT8", "IMAGE")
    np.testing.assert_allclose(image, pixels[:, None].astype(np.float32) / 16)
    logits = _call(client, "digits", "INPUT__0", image, "FP32", "OUTPUT__0")
    by_hand = _call(client, "digits_post", "LOGITS", logits, "FP32", "LABEL")
    assert labels.shape == (24, 1)
    assert labels.tolist() == by_hand.tolist()
    assert {label.decode() for label in labels.ravel()} <= {str(d) for d in range(10)}
