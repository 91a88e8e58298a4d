"""Ensembles under explicit model control: loaded, refused with Triton's reason, unloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.ensemble_repo import build, serving


def test_explicit_loads_of_ensembles(tmp_path: Path) -> None:
    repo = build(tmp_path)
    with serving(repo, None, "--model-control-mode", "explicit") as svc:
        client = httpclient.InferenceServerClient(svc.http_url)
        with pytest.raises(InferenceServerException, match="non-existing input NOPE in model inc"):
            client.load_model("broken_tensor")
        # loading the ensemble loads its composing models, as Triton does
        client.load_model("chain")
        assert client.is_model_ready("chain")
        assert client.is_model_ready("inc") and client.is_model_ready("double")
        x = np.array([[1.0]], dtype=np.float32)
        given = httpclient.InferInput("IN", [1, 1], "FP32")
        given.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("chain", [given]).as_numpy("OUT"), [[5.0]])
        client.unload_model("chain")
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["inc"]["state"] == "READY"
        assert index["chain"]["state"] in ("UNLOADING", "UNAVAILABLE")
