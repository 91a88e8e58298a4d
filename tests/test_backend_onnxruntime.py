"""The ONNX Runtime backend on its own: Triton's auto-complete from the graph, the config's
names checked against the graph with Triton's messages, session parameters, and results equal
to onnxruntime's own run of the same file. Models are built here with the onnx package."""

from __future__ import annotations

import re
import runpy
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import load_model_config
from sluice.shared.repository import scan_repository
from sluice.workers.backends import (
    BACKENDS,
    Backend,
    choose_device,
    complete_config,
    load_function,
    load_instance,
)
from sluice.workers.backends.onnxruntime import session_options
from sluice.workers.instances.stacked import StackedInstance

from tests.backend_models import load_error, model_instance, model_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RNG = np.random.default_rng(0)
WEIGHT = RNG.standard_normal((4, 3)).astype(np.float32)
BIAS = RNG.standard_normal(3).astype(np.float32)


def _save(graph: onnx.GraphProto, path: Path, *, external: bool = False) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # what onnxruntime 1.17 and later read
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(
        model, str(path), save_as_external_data=external, location="weights.bin", size_threshold=0
    )


def linear_graph(batch: str | int = "batch") -> onnx.GraphProto:
    """x [batch, 4] FP32 -> y = x @ W + b [batch, 3] and label = argmax(y) [batch] INT64."""
    return helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["y"]),
            helper.make_node("ArgMax", ["y"], ["label"], axis=1, keepdims=0),
        ],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3]),
            helper.make_tensor_value_info("label", TensorProto.INT64, [batch]),
        ],
        [numpy_helper.from_array(WEIGHT, "W"), numpy_helper.from_array(BIAS, "b")],
    )


def add_sub_graph() -> onnx.GraphProto:
    """a, b [N, 2] FP32 -> sum and difference."""
    pair = [None, 2]
    return helper.make_graph(
        [
            helper.make_node("Add", ["a", "b"], ["sum"]),
            helper.make_node("Sub", ["a", "b"], ["diff"]),
        ],
        "add_sub",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, pair) for n in ("a", "b")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, pair) for n in ("sum", "diff")],
    )


def strings_graph() -> onnx.GraphProto:
    """text [N] STRING -> the same strings."""
    return helper.make_graph(
        [helper.make_node("Identity", ["text"], ["echo"])],
        "strings",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["n"])],
        [helper.make_tensor_value_info("echo", TensorProto.STRING, ["n"])],
    )


def scalar_graph() -> onnx.GraphProto:
    """x [] FP32 -> 2x []: a model that cannot batch."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    return helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])],
        "scalar",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [two],
    )


def write_model(
    repo: Path, name: str, graph: onnx.GraphProto, config: str = "", *, directory: bool = False
) -> Path:
    """`<repo>/<name>/1/model.onnx` (a directory with external weights if asked) and a
    config.pbtxt of `platform: "onnxruntime_onnx"` plus `config`."""
    model_dir = repo / name
    path = model_dir / "1" / "model.onnx"
    _save(graph, path / "model.onnx" if directory else path, external=directory)
    (model_dir / "config.pbtxt").write_text(f'platform: "onnxruntime_onnx"\n{config}\n')
    return model_dir


def _ort_run(model_dir: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    path = model_dir / "1" / "model.onnx"
    path = path / "model.onnx" if path.is_dir() else path
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feed), strict=True))


LINEAR_CONFIG = """
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "y" data_type: TYPE_FP32 dims: [ 3 ] },
  { name: "label" data_type: TYPE_INT64 dims: [ 1 ] reshape { shape: [] } }
]
"""


# -- auto-complete -------------------------------------------------------------------------


def test_a_config_without_tensors_is_completed_from_the_graph(tmp_path: Path) -> None:
    """Every tensor has a symbolic first dim: batching, max_batch_size 4, dynamic batching,
    dims without the batch dim, and a [batch] tensor as dims [1] reshaped to []."""
    spec = model_spec(write_model(tmp_path, "auto", linear_graph()))
    assert spec.max_batch_size == 4
    assert spec.batching.dynamic
    assert [(t.name, t.datatype, t.dims, t.reshape) for t in spec.inputs] == [
        ("x", "FP32", (4,), None)
    ]
    assert [(t.name, t.datatype, t.dims, t.reshape) for t in spec.outputs] == [
        ("y", "FP32", (3,), None),
        ("label", "INT64", (1,), ()),
    ]
    assert spec.config_json["input"][0]["data_type"] == "TYPE_FP32"


def test_auto_complete_keeps_the_configs_batching(tmp_path: Path) -> None:
    """A max_batch_size given stays; dynamic batching only when it is above 1; a scheduler
    given stays as it is."""
    big = model_spec(write_model(tmp_path, "big", linear_graph(), "max_batch_size: 16"))
    assert (big.max_batch_size, big.batching.dynamic) == (16, True)
    one = model_spec(write_model(tmp_path, "one", linear_graph(), "max_batch_size: 1"))
    assert (one.max_batch_size, one.batching.dynamic) == (1, False)
    delayed = model_spec(
        write_model(
            tmp_path,
            "delayed",
            linear_graph(),
            "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 500 }",
        )
    )
    assert delayed.batching.max_queue_delay_us == 500


def test_a_graph_with_a_fixed_first_dim_does_not_batch(tmp_path: Path) -> None:
    spec = model_spec(write_model(tmp_path, "fixed", linear_graph(batch=2)))
    assert (spec.max_batch_size, spec.batching.dynamic) == (0, False)
    assert spec.inputs[0].dims == (2, 4)
    assert [t.dims for t in spec.outputs] == [(2, 3), (2,)]


def test_max_batch_size_on_a_graph_that_cannot_batch_is_triton_autofill_error(
    tmp_path: Path,
) -> None:
    model_dir = write_model(tmp_path, "fixed", linear_graph(batch=2), "max_batch_size: 8")
    entry = scan_repository(tmp_path, complete=complete_config)[0]
    assert entry.spec is None
    assert entry.error == (
        "autofill failed for model 'fixed': model does not support batching while non-zero "
        "max_batch_size is specified"
    )
    with pytest.raises(ModelConfigError):
        model_spec(model_dir)


def test_scalars_are_dims_one_without_batching(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "scalar", scalar_graph())
    spec = model_spec(model_dir)
    assert spec.max_batch_size == 0
    assert [(t.dims, t.reshape) for t in (*spec.inputs, *spec.outputs)] == [((1,), None)] * 2
    infer = load_function(spec, model_dir, 1, choose_device(spec), 0)
    out = infer({"x": torch.tensor([1.5])})
    assert out["y"].tolist() == [3.0]


def test_only_what_the_config_leaves_out_is_completed(tmp_path: Path) -> None:
    """Outputs given, inputs left out: the inputs come from the graph, the outputs stay (a
    subset of the graph's)."""
    config = 'max_batch_size: 8\noutput [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]'
    spec = model_spec(write_model(tmp_path, "half", linear_graph(), config))
    assert [t.name for t in spec.inputs] == ["x"]
    assert [t.name for t in spec.outputs] == ["y"]
    assert spec.max_batch_size == 8


def test_a_full_config_is_not_completed(tmp_path: Path) -> None:
    spec = model_spec(write_model(tmp_path, "full", linear_graph(), LINEAR_CONFIG))
    assert (spec.max_batch_size, spec.batching.dynamic) == (8, False)


def test_platform_or_backend_select_it_and_a_directory_holds_the_model(tmp_path: Path) -> None:
    """`backend: "onnxruntime"` as well as the platform; `model.onnx/model.onnx` with its
    weights in an external file beside it."""
    model_dir = write_model(tmp_path, "dir", linear_graph(), directory=True)
    (model_dir / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    assert (model_dir / "1" / "model.onnx" / "weights.bin").is_file()
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    out = model_instance(model_dir)({"x": torch.from_numpy(x)})
    expected = _ort_run(model_dir, {"x": x})
    np.testing.assert_array_equal(out["y"], expected["y"])


# -- running -------------------------------------------------------------------------------


def test_results_equal_onnxruntimes_own_run(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "linear", linear_graph(), LINEAR_CONFIG)
    x = RNG.standard_normal((5, 4)).astype(np.float32)
    out = model_instance(model_dir)({"x": torch.from_numpy(x)})
    expected = _ort_run(model_dir, {"x": x})
    np.testing.assert_array_equal(out["y"], expected["y"])
    np.testing.assert_array_equal(out["label"], expected["label"])
    np.testing.assert_allclose(out["y"], x @ WEIGHT + BIAS, rtol=1e-5, atol=1e-6)


def test_only_the_configs_outputs_are_computed(tmp_path: Path) -> None:
    config = (
        'max_batch_size: 8\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "label" data_type: TYPE_INT64 dims: [ 1 ] reshape { shape: [] } } ]'
    )
    infer = model_instance(write_model(tmp_path, "subset", linear_graph(), config))
    out = infer({"x": torch.zeros(2, 4)})
    assert set(out) == {"label"}


def test_strings_in_and_out(tmp_path: Path) -> None:
    """BYTES inputs (numpy object arrays of bytes) reach the graph as strings."""
    infer = model_instance(write_model(tmp_path, "strings", strings_graph()))
    text = np.array([b"hello", "wörld".encode()], dtype=object)
    out = infer({"text": text})
    assert out["echo"].tolist() == ["hello", "wörld"]


def test_inputs_reach_onnxruntime_as_views_of_the_stacked_tensors(tmp_path: Path) -> None:
    """No copy on the way in: the numpy array fed shares the torch tensor's memory."""
    fed: list[np.ndarray] = []
    original = ort.InferenceSession.run

    def spy(self: Any, names: Any, feed: dict[str, np.ndarray], *args: Any) -> Any:
        fed.extend(feed.values())
        return original(self, names, feed, *args)

    infer = model_instance(write_model(tmp_path, "linear", linear_graph(), LINEAR_CONFIG))
    x = torch.ones(2, 4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ort.InferenceSession, "run", spy)
        infer({"x": x})
    assert np.shares_memory(fed[0], x.numpy())


# -- config checked against the graph ------------------------------------------------------


_TWO_INPUTS = (
    'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] },'
    ' { name: "z" data_type: TYPE_FP32 dims: [ 4 ] } ]'
)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]',
            _TWO_INPUTS,
            "unable to load model 'linear', configuration expects 2 inputs, model provides 1",
        ),
        (
            'name: "x"',
            'name: "INPUT__0"',
            "unexpected inference input 'INPUT__0', allowed inputs are: x",
        ),
        (
            'name: "y"',
            'name: "probs"',
            "unexpected inference output 'probs', allowed outputs are: label, y",
        ),
        (
            "TYPE_INT64",
            "TYPE_INT32",
            "unable to load model 'linear', configuration expects datatype TYPE_INT32 for "
            "output 'label', model provides TYPE_INT64",
        ),
        (
            "dims: [ 4 ]",
            "dims: [ 4 ] optional: true",
            "unable to load model 'linear', optional input 'x' is not supported for models "
            "that support batching",
        ),
    ],
)
def test_a_config_the_graph_contradicts_gets_tritons_message(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    config = LINEAR_CONFIG.replace(old, new)
    assert config != LINEAR_CONFIG
    assert load_error(write_model(tmp_path, "linear", linear_graph(), config)) == message


def test_a_shape_mismatch(tmp_path: Path) -> None:
    config = LINEAR_CONFIG.replace("dims: [ 4 ]", "dims: [ 5 ]")
    message = load_error(write_model(tmp_path, "linear", linear_graph(), config))
    assert "tensor 'x'" in message and "[4]" in message and "[5]" in message


def test_batching_a_graph_whose_first_dim_is_fixed(tmp_path: Path) -> None:
    message = load_error(write_model(tmp_path, "fixed", linear_graph(batch=2), LINEAR_CONFIG))
    assert "the first dimension must be -1" in message


def test_a_file_that_is_not_onnx(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "junk", linear_graph(), LINEAR_CONFIG)
    (model_dir / "1" / "model.onnx").write_bytes(b"not a model")
    assert "cannot load ONNX model" in load_error(model_dir)


# -- session parameters ----------------------------------------------------------------------


def test_tritons_session_parameters_are_applied(tmp_path: Path) -> None:
    params = {
        "intra_op_thread_count": "3",
        "inter_op_thread_count": "2",
        "execution_mode": "1",
        "enable_mem_arena": "0",
        "enable_mem_pattern": "false",
    }
    text = "".join(
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in params.items()
    )
    text += "optimization { graph { level: 2 } }"
    model_dir = write_model(tmp_path, "tuned", linear_graph(), LINEAR_CONFIG + text)
    options = session_options(model_spec(model_dir), model_dir)
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (3, 2)
    assert options.execution_mode == ort.ExecutionMode.ORT_PARALLEL
    assert (options.enable_cpu_mem_arena, options.enable_mem_pattern) == (False, False)
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert model_instance(model_dir)({"x": torch.zeros(1, 4)})["y"].shape == (1, 3)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ('parameters { key: "intra_op_thread_count" value { string_value: "many" } }', "intra"),
        ('parameters { key: "execution_mode" value { string_value: "2" } }', "execution_mode"),
        ("optimization { graph { level: 5 } }", "optimization.graph.level"),
    ],
)
def test_a_bad_parameter_is_named(tmp_path: Path, extra: str, field: str) -> None:
    message = load_error(write_model(tmp_path, "bad", linear_graph(), LINEAR_CONFIG + extra))
    assert field in message


# -- the backend seam --------------------------------------------------------------------------


def test_a_missing_package_makes_the_model_unavailable_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend whose package is not installed: its models say which extra to install (at
    auto-complete and at load), the others load."""
    absent = Backend("onnxruntime", ("sluice_absent_package",), "onnx", host_inputs=True)
    monkeypatch.setitem(BACKENDS, "onnxruntime", absent)
    write_model(tmp_path, "auto", linear_graph())
    model_dir = write_model(tmp_path, "full", linear_graph(), LINEAR_CONFIG)
    (tmp_path / "py" / "1").mkdir(parents=True)
    (tmp_path / "py" / "1" / "model.py").write_text(
        "class Model:\n    def __init__(self, context):\n        pass\n\n"
        "    def infer(self, inputs):\n        return {'B': inputs['A']}\n"
    )
    (tmp_path / "py" / "config.pbtxt").write_text(
        'backend: "python"\ninput [ { name: "A" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "B" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    )
    reason = "needs the sluice_absent_package package: pip install 'sluice-serve[onnx]'"
    entries = {e.name: e for e in scan_repository(tmp_path, complete=complete_config)}
    assert entries["auto"].error == f"model 'auto' {reason}"
    assert entries["full"].error == f"model 'full' {reason}"
    assert entries["py"].error is None and entries["py"].spec is not None
    spec = load_model_config(model_dir)
    with pytest.raises(ModelConfigError, match=re.escape(f"model 'full' {reason}")):
        load_function(spec, model_dir, 1, choose_device(spec), 0)
    python = entries["py"].spec
    instance = load_instance(python, tmp_path / "py", 1, choose_device(python), 0)
    assert isinstance(instance, StackedInstance)
    assert instance.function({"A": torch.ones(1, 1)})["B"].tolist() == [[1.0]]


def test_onnx_inputs_are_stacked_on_the_host(tmp_path: Path) -> None:
    """The CUDA provider copies the inputs itself, so the worker stacks them in host memory."""
    spec = model_spec(
        write_model(tmp_path, "gpu", linear_graph(), "instance_group [ { kind: KIND_GPU } ]")
    )
    assert choose_device(spec) == torch.device("cpu")


def test_a_model_exported_by_torch_onnx_serves_as_torch_computes(tmp_path: Path) -> None:
    """torch.onnx.export (its TorchScript-based exporter, which needs no onnxscript) with a
    dynamic batch dimension: auto-completed, and the same numbers as the torch module."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    path = tmp_path / "exported" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            module,
            (torch.zeros(1, 6),),
            str(path),
            input_names=["features"],
            output_names=["scores"],
            dynamic_axes={"features": {0: "n"}, "scores": {0: "n"}},
            dynamo=False,
        )
    (tmp_path / "exported" / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    spec = model_spec(tmp_path / "exported")
    assert (spec.max_batch_size, spec.inputs[0].dims, spec.outputs[0].dims) == (4, (6,), (2,))
    x = torch.randn(3, 6)
    out = load_function(spec, tmp_path / "exported", 1, choose_device(spec), 0)({"features": x})
    with torch.no_grad():
        np.testing.assert_allclose(out["scores"], module(x).numpy(), rtol=1e-5, atol=1e-6)


def test_the_example_mlp_onnx_is_the_reference_mlp(tmp_path: Path) -> None:
    """examples/build_models.py exports `mlp`'s weights: mlp_onnx, under its committed config,
    answers as the reference MLP does."""
    builders = runpy.run_path(str(EXAMPLES / "build_models.py"))
    model_dir = tmp_path / "mlp_onnx"
    (model_dir / "1").mkdir(parents=True)
    shutil.copy(EXAMPLES / "model_repository" / "mlp_onnx" / "config.pbtxt", model_dir)
    builders["build_mlp_onnx"](model_dir / "1")
    x = torch.randn(3, 512)
    out = model_instance(model_dir)({"INPUT__0": x})["OUTPUT__0"]
    with torch.no_grad():
        np.testing.assert_allclose(out, builders["reference_mlp"]()(x).numpy(), atol=1e-5)
