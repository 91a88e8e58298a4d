"""Triton's model warm-up: samples run on every instance before the model is ready, and a
sample that fails keeps the model unavailable with Triton's reason."""

from __future__ import annotations

import json
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import serving_alone

MODEL = textwrap.dedent('''
    import os

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        """Notes each call (its requests and the sum of their inputs) in calls.txt beside its
        version folder; fails every call when its model is named 'failing'."""

        def initialize(self, args):
            self.failing = args["model_name"] == "failing"
            self.log = os.path.join(args["model_repository"], "calls.txt")

        def execute(self, requests):
            if self.failing:
                raise pb_utils.TritonModelException("not warm yet")
            total = sum(
                float(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().sum())
                for r in requests
            )
            with open(self.log, "a") as log:
                log.write(f"{len(requests)} {total}\\n")
            return [
                pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.zeros([1, 4], np.float32))])
                for _ in requests
            ]
''')

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "IN", data_type: TYPE_FP32, dims: [ 4 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 2 }} ]
model_warmup [
  {{
    name: "w"
    batch_size: 3
    count: 2
    inputs {{ key: "IN" value: {{ data_type: TYPE_FP32, dims: [ 4 ], {data} }} }}
  }}
]
"""


DECOUPLED_MODEL = textwrap.dedent('''
    import os

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        """Decoupled: one response and a final flag per request, noting each call's requests
        in calls.txt; every response an error when its model is named 'decoupled_failing'."""

        def initialize(self, args):
            self.failing = args["model_name"] == "decoupled_failing"
            self.log = os.path.join(args["model_repository"], "calls.txt")

        def execute(self, requests):
            final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            for request in requests:
                sender = request.get_response_sender()
                if self.failing:
                    error = pb_utils.TritonError("still cold")
                    sender.send(pb_utils.InferenceResponse(error=error), flags=final)
                    continue
                out = pb_utils.Tensor("OUT", np.zeros([1, 4], np.float32))
                sender.send(pb_utils.InferenceResponse([out]))
                sender.send(flags=final)
            with open(self.log, "a") as log:
                log.write(f"{len(requests)}\\n")
            return None
''')

DECOUPLED = "model_transaction_policy { decoupled: true }\n"


def _model(repo: Path, name: str, data: str) -> Path:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, data=data))
    (repo / name / "1" / "model.py").write_text(MODEL)
    return repo / name


def _index(http_url: str) -> dict[str, Any]:
    request = urllib.request.Request(f"http://{http_url}/v2/repository/index", b"{}")
    with urllib.request.urlopen(request, timeout=10) as reply:
        return {m["name"]: m for m in json.loads(reply.read())}


def test_a_decoupled_model_is_warmed_up_until_every_request_has_its_final_response(
    tmp_path: Path,
) -> None:
    for name in ("decoupled_warm", "decoupled_failing"):
        folder = _model(tmp_path, name, "zero_data: true")
        (folder / "config.pbtxt").write_text((folder / "config.pbtxt").read_text() + DECOUPLED)
        (folder / "1" / "model.py").write_text(DECOUPLED_MODEL)
    with serving_alone(tmp_path) as service:
        index = _index(service.http_url)
    assert index["decoupled_warm"]["state"] == "READY"
    # count 2 on each of two instances: four calls of three requests
    assert (tmp_path / "decoupled_warm" / "calls.txt").read_text() == "3\n" * 4
    assert index["decoupled_failing"]["state"] == "UNAVAILABLE"
    assert index["decoupled_failing"]["reason"] == "failed to run warmup sample 'w': still cold"


def test_warmup_runs_on_every_instance_before_the_model_is_ready_and_a_failure_keeps_it_out(
    tmp_path: Path,
) -> None:
    zeros = _model(tmp_path, "zeros", "zero_data: true")
    from_file = _model(tmp_path, "from_file", 'input_data_file: "ones"')
    (from_file / "warmup").mkdir()
    (from_file / "warmup" / "ones").write_bytes(b"\x00\x00\x80\x3f" * 4)  # four FP32 ones
    _model(tmp_path, "failing", "random_data: true")
    _model(tmp_path, "outside", 'input_data_file: "../config.pbtxt"')
    with serving_alone(tmp_path) as service:
        index = _index(service.http_url)
        url = f"http://{service.http_url}/v2/models/zeros/stats"
        with urllib.request.urlopen(url, timeout=10) as reply:
            stats = json.loads(reply.read())["model_stats"][0]
    # count 2 on each of two instances: four calls of three requests each, before READY
    assert (zeros / "calls.txt").read_text() == "3 0.0\n" * 4
    assert (from_file / "calls.txt").read_text() == "3 12.0\n" * 4
    assert index["zeros"]["state"] == "READY"
    # the runs count in the model's statistics, as Triton counts them
    assert (stats["inference_count"], stats["execution_count"]) == (12, 4)
    assert stats["inference_stats"]["success"]["count"] == 12
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [
        (3, 4)
    ]
    assert index["failing"]["state"] == "UNAVAILABLE"
    assert index["failing"]["reason"].startswith(
        "failed to run warmup sample 'w': Failed to process the request(s) for model 'failing'"
    )
    assert "not warm yet" in index["failing"]["reason"]
    assert index["outside"]["state"] == "UNAVAILABLE"
    assert index["outside"]["reason"] == (
        "warmup input data file '../config.pbtxt' is not a file in warmup/ of the model"
    )
