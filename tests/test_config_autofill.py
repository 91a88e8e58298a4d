"""Triton's autofill of a model folder without config.pbtxt, or with a load's partial config
override: the backend comes from the model's files, then the backend's own auto-complete
fills the rest (a Python model's `auto_complete_config`, an ONNX graph's tensors)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper
from sluice.shared.model_config import load_model_config
from sluice.shared.repository import scan_model
from sluice.workers.backends import complete_config
from tritonclient.grpc.model_config_pb2 import ModelConfig

# python_backend's examples/auto_complete/batch_model.py, in short.
AUTO_COMPLETED = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        names = [i["name"] for i in config.as_dict()["input"]]
        for name in ("INPUT0", "INPUT1"):
            if name not in names:
                config.add_input({"name": name, "data_type": "TYPE_FP32", "dims": [4]})
        config.add_output({"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]})
        config.set_max_batch_size(4)
        config.set_dynamic_batching()
        return config

    def execute(self, requests):
        return []
"""
PLAIN = """
class TritonPythonModel:
    def execute(self, requests):
        return []
"""


def _python_model(repo: Path, name: str, source: str, config: str | None = None) -> Path:
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text(textwrap.dedent(source))
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config)
    return model_dir


def test_a_python_model_without_config_is_completed_by_its_hook(tmp_path: Path) -> None:
    entry = scan_model(_python_model(tmp_path, "batch", AUTO_COMPLETED), complete=complete_config)
    assert entry.error is None
    assert entry.spec is not None
    spec = entry.spec
    assert (spec.kind, spec.backend, spec.platform) == ("python", "python", "python")
    assert spec.max_batch_size == 4
    assert spec.batching.dynamic
    assert [(t.name, t.datatype, t.dims) for t in spec.inputs] == [
        ("INPUT0", "FP32", (4,)),
        ("INPUT1", "FP32", (4,)),
    ]
    assert spec.config_json["name"] == "batch"
    assert spec.config_json["default_model_filename"] == "model.py"


def test_a_python_model_may_declare_no_tensors(tmp_path: Path) -> None:
    """Triton loads it: the model takes no inputs and names no outputs."""
    entry = scan_model(_python_model(tmp_path, "bare", PLAIN), complete=complete_config)
    assert entry.error is None
    assert entry.spec is not None
    assert (entry.spec.inputs, entry.spec.outputs, entry.spec.max_batch_size) == ((), (), 0)


TENSORS_ONLY = """
class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [1]})
        config.add_output({"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]})
        return config
"""


@pytest.mark.parametrize("override", ['{"max_batch_size": "16"}', '{"max_batch_size": 16}'])
def test_a_partial_override_is_completed_from_the_files(tmp_path: Path, override: str) -> None:
    """client's simple_*_model_control examples: the override replaces config.pbtxt whole,
    the backend is found from 1/model.py and the model's hook adds the tensors, if any."""
    on_disk = 'backend: "python"\nmax_batch_size: 8\n'
    hooked = _python_model(tmp_path, "simple", TENSORS_ONLY, on_disk)
    spec = load_model_config(hooked, config_json=override, complete=complete_config)
    assert (spec.kind, spec.max_batch_size) == ("python", 16)
    assert [t.name for t in spec.inputs] == ["IN"]
    plain = _python_model(tmp_path, "plain", PLAIN, on_disk)
    spec = load_model_config(plain, config_json=override, complete=complete_config)
    assert (spec.kind, spec.max_batch_size, spec.inputs) == ("python", 16, ())


def test_an_override_the_hook_disagrees_with_is_its_error(tmp_path: Path) -> None:
    """As Triton's pb_utils.ModelConfig.set_max_batch_size: the config's 16 is not the 4 the
    hook sets."""
    model_dir = _python_model(tmp_path, "simple", AUTO_COMPLETED)
    entry = scan_model(model_dir, config_json='{"max_batch_size": 16}', complete=complete_config)
    assert entry.error is not None
    assert "configuration specified max_batch_size 16" in entry.error


def _recorded(tmp_path: Path, files: dict[str, str], config: str = "") -> tuple[str, str, str]:
    """(platform, backend, default_model_filename) the completer sees for a model folder
    holding `files` under `1/` ("dir": a directory)."""
    model_dir = tmp_path / "m"
    for name, kind in files.items():
        path = model_dir / "1" / name
        if kind == "dir":
            path.mkdir(parents=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
    if config:
        (model_dir / "config.pbtxt").write_text(config)
    seen: list[tuple[str, str, str]] = []

    def record(cfg: ModelConfig, _model_dir: Path) -> None:
        seen.append((cfg.platform, cfg.backend, cfg.default_model_filename))
        cfg.input.add(name="X", data_type=TensorProto.FLOAT, dims=[1])
        cfg.output.add(name="Y", data_type=TensorProto.FLOAT, dims=[1])

    load_model_config(model_dir, complete=record)
    return seen[0]


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"model.savedmodel": "dir"}, ("tensorflow_savedmodel", "tensorflow", "model.savedmodel")),
        ({"model.plan": "file"}, ("tensorrt_plan", "tensorrt", "model.plan")),
        ({"model.onnx": "file"}, ("onnxruntime_onnx", "onnxruntime", "model.onnx")),
        ({"model.onnx": "dir"}, ("onnxruntime_onnx", "onnxruntime", "model.onnx")),
        ({"model.xml": "file", "model.bin": "file"}, ("", "openvino", "model.xml")),
        ({"model.pt": "file"}, ("pytorch_libtorch", "pytorch", "model.pt")),
        ({"model.py": "file"}, ("", "python", "model.py")),
        # Triton's order when several are there: ONNX before Python
        (
            {"model.py": "file", "model.onnx": "file"},
            ("onnxruntime_onnx", "onnxruntime", "model.onnx"),
        ),
    ],
)
def test_the_backend_is_found_from_the_model_file(
    tmp_path: Path, files: dict[str, str], expected: tuple[str, str, str]
) -> None:
    assert _recorded(tmp_path, files) == expected


def test_default_model_filename_names_the_backend(tmp_path: Path) -> None:
    config = 'default_model_filename: "model.py"\n'
    assert _recorded(tmp_path, {"model.py": "file"}, config) == ("", "python", "model.py")


def test_only_the_first_version_directory_is_looked_at(tmp_path: Path) -> None:
    """As Triton: "10" comes before "2" in name order, and it holds no model file."""
    model_dir = tmp_path / "m"
    (model_dir / "10").mkdir(parents=True)
    (model_dir / "2").mkdir()
    (model_dir / "2" / "model.py").write_text(PLAIN)
    entry = scan_model(model_dir, complete=complete_config)
    assert entry.error is not None
    assert "Could not determine backend for model" in entry.error


def test_a_folder_nothing_recognisable_in_is_refused_as_triton_does(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "weights.bin").write_bytes(b"x")
    entry = scan_model(tmp_path / "m", complete=complete_config)
    assert entry.spec is None
    assert entry.error is not None
    assert "Could not determine backend for model" in entry.error


def test_an_onnx_model_without_config_is_completed_from_its_graph(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (tmp_path / "relu" / "1").mkdir(parents=True)
    onnx.save(model, str(tmp_path / "relu" / "1" / "model.onnx"))
    entry = scan_model(tmp_path / "relu", complete=complete_config)
    assert entry.error is None
    assert entry.spec is not None
    assert entry.spec.platform == "onnxruntime_onnx"
    assert [(t.name, t.dims) for t in entry.spec.inputs] == [("x", (3,))]
    assert entry.spec.max_batch_size == 4


def test_other_backends_still_need_their_tensors(tmp_path: Path) -> None:
    """A TorchScript file says nothing about its tensors: its config must list them."""
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.pt").write_bytes(b"x")
    entry = scan_model(tmp_path / "m", complete=complete_config)
    assert entry.error is not None
    assert "input: must list at least one tensor" in entry.error
