"""The OpenVINO backend on its own: Triton's auto-complete from the model, the config checked
against the model with Triton's messages, the openvino parameters as the compiled model's
properties, the batch dim, and results equal to ONNX Runtime's run of the same graph. Models
are built here with the onnx package and converted with openvino's own converter. A TensorRT
plan on this GPU-less machine is UNAVAILABLE with the reason."""

from __future__ import annotations

import runpy
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import openvino as ov
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import load_model_config
from sluice.shared.repository import scan_repository
from sluice.workers.backends import choose_device, complete_config, load_function
from sluice.workers.backends.openvino import compile_model, parse_options

from tests.backend_models import load_error, model_instance, model_spec, run_script

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RNG = np.random.default_rng(0)
WEIGHT = RNG.standard_normal((4, 3)).astype(np.float32)
BIAS = RNG.standard_normal(3).astype(np.float32)


def dense_graph(batch: str | int = "batch") -> onnx.GraphProto:
    """x [batch, 4] FP32 -> y = relu(x @ W + b) [batch, 3] FP32, top = argmax(y) [batch, 1]
    INT64."""
    return helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["xw"]),
            helper.make_node("Add", ["xw", "b"], ["pre"]),
            helper.make_node("Relu", ["pre"], ["y"]),
            helper.make_node("ArgMax", ["y"], ["top"], axis=1, keepdims=1),
        ],
        "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3]),
            helper.make_tensor_value_info("top", TensorProto.INT64, [batch, 1]),
        ],
        [numpy_helper.from_array(WEIGHT, "W"), numpy_helper.from_array(BIAS, "b")],
    )


def write_model(
    repo: Path,
    name: str,
    graph: onnx.GraphProto,
    config: str = "",
    *,
    layout: str | None = None,
    as_onnx: bool = False,
) -> Path:
    """`<repo>/<name>/1/model.xml` + `model.bin` converted from the graph by openvino (each
    tensor given `layout` if asked), or the ONNX file itself as `model.onnx`; a config.pbtxt
    of `backend: "openvino"` plus `config`."""
    model_dir = repo / name
    version = model_dir / "1"
    version.mkdir(parents=True)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx_path = version / "model.onnx"
    onnx.save(model, str(onnx_path))
    head = 'backend: "openvino"\n'
    if as_onnx:
        head += 'default_model_filename: "model.onnx"\n'
    else:
        converted = ov.convert_model(str(onnx_path))
        onnx_path.unlink()
        for port in [*converted.inputs, *converted.outputs] if layout else []:
            port.get_node().set_layout(ov.Layout(layout))
        ov.save_model(converted, str(version / "model.xml"), compress_to_fp16=False)
    (model_dir / "config.pbtxt").write_text(head + config + "\n")
    return model_dir


def numpy_dense(x: np.ndarray) -> dict[str, np.ndarray]:
    y = np.maximum(x @ WEIGHT + BIAS, 0)
    return {"y": y, "top": y.argmax(axis=1, keepdims=True)}


DENSE_CONFIG = """
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "y" data_type: TYPE_FP32 dims: [ 3 ] },
  { name: "top" data_type: TYPE_INT64 dims: [ 1 ] }
]
"""


# -- auto-complete -------------------------------------------------------------------------


def test_a_model_whose_layouts_have_a_batch_dim_is_completed_batching(tmp_path: Path) -> None:
    """Every tensor's layout has N: max_batch_size 4, dynamic batching, dims after the batch."""
    spec = model_spec(write_model(tmp_path, "auto", dense_graph(), layout="N..."))
    assert (spec.max_batch_size, spec.batching.dynamic) == (4, True)
    assert [(t.name, t.datatype, t.dims) for t in spec.inputs] == [("x", "FP32", (4,))]
    assert [(t.name, t.datatype, t.dims) for t in spec.outputs] == [
        ("y", "FP32", (3,)),
        ("top", "INT64", (1,)),
    ]
    assert spec.model_filename == "model.xml"


def test_a_model_xml_without_config_pbtxt_is_found_and_completed(tmp_path: Path) -> None:
    """Triton's autofill: a `model.xml` makes it an OpenVINO model."""
    model_dir = write_model(tmp_path, "bare", dense_graph(), layout="N...")
    (model_dir / "config.pbtxt").unlink()
    spec = model_spec(model_dir)
    assert (spec.kind, spec.backend, spec.max_batch_size) == ("openvino", "openvino", 4)
    assert [t.name for t in spec.outputs] == ["y", "top"]


def test_a_model_without_layouts_is_completed_without_batching(tmp_path: Path) -> None:
    """No layout (a converted ONNX model): no batching, the whole shape as dims (-1 for the
    dynamic first dim); each request carries its own rows."""
    model_dir = write_model(tmp_path, "plain", dense_graph())
    spec = model_spec(model_dir)
    assert (spec.max_batch_size, spec.batching.dynamic) == (0, False)
    assert [t.dims for t in (*spec.inputs, *spec.outputs)] == [(-1, 4), (-1, 3), (-1, 1)]
    x = RNG.standard_normal((5, 4)).astype(np.float32)
    out = load_function(spec, model_dir, 1, choose_device(spec), 0)({"x": torch.from_numpy(x)})
    np.testing.assert_allclose(out["y"], numpy_dense(x)["y"], rtol=1e-6, atol=1e-6)


def test_a_given_max_batch_size_takes_the_batch_dim_off_the_completed_dims(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """max_batch_size in config.pbtxt and no layout: Triton warns and completes the tensors
    without their first dim; the model batches."""
    model_dir = write_model(tmp_path, "given", dense_graph(), "max_batch_size: 8")
    spec = model_spec(model_dir)
    assert "does not support batching while non-zero max_batch_size" in caplog.text
    assert (spec.max_batch_size, spec.batching.dynamic) == (8, False)
    assert [t.dims for t in (*spec.inputs, *spec.outputs)] == [(4,), (3,), (1,)]
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    out = load_function(spec, model_dir, 1, choose_device(spec), 0)({"x": torch.from_numpy(x)})
    np.testing.assert_array_equal(out["top"], numpy_dense(x)["top"])


def test_only_what_the_config_leaves_out_is_completed(tmp_path: Path) -> None:
    config = 'max_batch_size: 2\noutput [ { name: "top" data_type: TYPE_INT64 dims: [ 1 ] } ]'
    spec = model_spec(write_model(tmp_path, "half", dense_graph(), config, layout="N..."))
    assert [t.name for t in spec.inputs] == ["x"]
    assert [t.name for t in spec.outputs] == ["top"]
    assert (spec.max_batch_size, spec.batching.dynamic) == (2, True)


def test_an_onnx_file_is_read_directly(tmp_path: Path) -> None:
    """`default_model_filename: "model.onnx"`: OpenVINO reads the ONNX file itself."""
    model_dir = write_model(tmp_path, "onnx", dense_graph(), DENSE_CONFIG, as_onnx=True)
    x = RNG.standard_normal((6, 4)).astype(np.float32)
    out = model_instance(model_dir)({"x": torch.from_numpy(x)})
    session = ort.InferenceSession(str(model_dir / "1" / "model.onnx"))
    y, top = session.run(["y", "top"], {"x": x})
    np.testing.assert_allclose(out["y"], y, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out["top"], top)


# -- running -------------------------------------------------------------------------------


def test_any_batch_up_to_max_batch_size_runs_as_it_is(tmp_path: Path) -> None:
    """The batch dim becomes dynamic (1..max_batch_size): batches of 1, 3 and 8 rows, each
    equal to numpy's answer on the same rows."""
    model_dir = write_model(tmp_path, "dense", dense_graph(), DENSE_CONFIG)
    compiled, fixed = compile_model(model_spec(model_dir), model_dir, 1)
    assert fixed == 0
    assert str(compiled.inputs[0].get_partial_shape()) == "[1..8,4]"
    infer = model_instance(model_dir)
    for rows in (1, 3, 8):
        x = RNG.standard_normal((rows, 4)).astype(np.float32)
        out = infer({"x": torch.from_numpy(x)})
        expected = numpy_dense(x)
        np.testing.assert_allclose(out["y"], expected["y"], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(out["top"], expected["top"])
        assert out["top"].dtype == np.int64


_FREED_ELSEWHERE_SCRIPT = """
import gc, os, signal, sys, threading
from pathlib import Path
import numpy as np, torch
from tests.backend_models import model_instance

infer = model_instance(Path(sys.argv[1]))
infer({"x": torch.from_numpy(np.ones((2, 4), np.float32))})

def drop():
    global infer
    del infer
    gc.collect()

dropper = threading.Thread(target=drop)
dropper.start()
dropper.join()
handled = threading.Event()
signal.signal(signal.SIGUSR1, lambda *_: handled.set())
os.kill(os.getpid(), signal.SIGUSR1)
print("handled" if handled.is_set() else "not handled")
"""


def test_a_signal_after_the_model_was_freed_on_another_thread_is_handled(
    tmp_path: Path,
) -> None:
    """The thread that compiled a model keeps its own signal stack: OpenVINO's, unmapped when
    another thread frees the model, made the next signal kill the process with SIGSEGV."""
    model_dir = write_model(tmp_path, "dense", dense_graph(), DENSE_CONFIG)
    done = run_script(_FREED_ELSEWHERE_SCRIPT, str(model_dir))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["handled"]


def test_a_model_with_a_fixed_batch_of_one_takes_larger_batches(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "one", dense_graph(batch=1), DENSE_CONFIG)
    x = RNG.standard_normal((4, 4)).astype(np.float32)
    out = model_instance(model_dir)({"x": torch.from_numpy(x)})
    np.testing.assert_allclose(out["y"], numpy_dense(x)["y"], rtol=1e-6, atol=1e-6)


def test_batch_padding_fixes_the_batch_and_pads_smaller_ones(tmp_path: Path) -> None:
    """ENABLE_BATCH_PADDING: the model takes exactly max_batch_size rows; a batch of 3 is
    padded and answers its 3 rows."""
    config = (
        DENSE_CONFIG + 'parameters { key: "ENABLE_BATCH_PADDING" value { string_value: "yes" } }'
    )
    model_dir = write_model(tmp_path, "padded", dense_graph(), config)
    compiled, fixed = compile_model(model_spec(model_dir), model_dir, 1)
    assert (fixed, str(compiled.inputs[0].get_partial_shape())) == (8, "[8,4]")
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    out = model_instance(model_dir)({"x": torch.from_numpy(x)})
    assert out["y"].shape == (3, 3)
    np.testing.assert_allclose(out["y"], numpy_dense(x)["y"], rtol=1e-6, atol=1e-6)


def test_a_config_type_other_than_the_models_is_converted(tmp_path: Path) -> None:
    """FP16 in and out for an FP32 model, INT32 for its INT64 output, as Triton converts."""
    config = DENSE_CONFIG.replace("TYPE_FP32", "TYPE_FP16").replace("TYPE_INT64", "TYPE_INT32")
    model_dir = write_model(tmp_path, "half", dense_graph(), config)
    x = RNG.standard_normal((2, 4)).astype(np.float16)
    out = model_instance(model_dir)({"x": torch.from_numpy(x)})
    assert (out["y"].dtype, out["top"].dtype) == (np.float16, np.int32)
    np.testing.assert_allclose(out["y"], numpy_dense(x.astype(np.float32))["y"], atol=1e-2)


def test_reshape_io_layers_gives_the_inputs_the_configs_dims(tmp_path: Path) -> None:
    """A model fixed at [2, 4] without batching: dims [-1, 4] contradict it, unless
    RESHAPE_IO_LAYERS reshapes the input to them."""
    config = """
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]
"""
    fixed = write_model(tmp_path, "fixed", dense_graph(batch=2), config)
    assert load_error(fixed) == (
        "model 'fixed', tensor 'x': the model expects 2 dimensions (shape [2,4]) but the model "
        "configuration specifies 2 dimensions (shape [-1,4])"
    )
    reshape = 'parameters { key: "RESHAPE_IO_LAYERS" value { string_value: "YES" } }'
    model_dir = write_model(tmp_path, "reshaped", dense_graph(batch=2), config + reshape)
    x = RNG.standard_normal((5, 4)).astype(np.float32)
    out = model_instance(model_dir)({"x": torch.from_numpy(x)})
    np.testing.assert_allclose(out["y"], numpy_dense(x)["y"], rtol=1e-6, atol=1e-6)


# -- parameters ----------------------------------------------------------------------------


def _with_parameters(tmp_path: Path, name: str, **parameters: str) -> Path:
    lines = "".join(
        f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'
        for key, value in parameters.items()
    )
    return write_model(tmp_path, name, dense_graph(), DENSE_CONFIG + lines)


def test_parameters_are_the_compiled_models_properties(tmp_path: Path) -> None:
    model_dir = _with_parameters(
        tmp_path,
        "tuned",
        NUM_STREAMS="2",
        INFERENCE_NUM_THREADS="2",
        PERFORMANCE_HINT="throughput",
        HINT_BF16="YES",
    )
    compiled, _ = compile_model(model_spec(model_dir), model_dir, 1)
    assert compiled.get_property("NUM_STREAMS") == 2
    assert compiled.get_property("INFERENCE_NUM_THREADS") == 2
    assert compiled.get_property("PERFORMANCE_HINT") == "THROUGHPUT"
    asked = parse_options({"HINT_BF16": "YES"}, lambda _, message: ModelConfigError(message))
    assert ov.Type.bf16 in asked.properties.values()
    # bf16 where the CPU computes in it (AVX-512 BF16, AMX); on one without, OpenVINO keeps
    # f32 or (OpenVINO 2026.4 here) reports the hint as asked
    capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    expected = (ov.Type.bf16,) if "BF16" in capabilities else (ov.Type.f32, ov.Type.bf16)
    assert compiled.get_property("INFERENCE_PRECISION_HINT") in expected


def test_without_parameters_the_model_computes_in_f32_with_one_stream(tmp_path: Path) -> None:
    """f32 whatever the CPU (OpenVINO would pick bf16 where the CPU has it), latency-first."""
    model_dir = write_model(tmp_path, "plain", dense_graph(), DENSE_CONFIG)
    compiled, _ = compile_model(model_spec(model_dir), model_dir, 1)
    assert compiled.get_property("INFERENCE_PRECISION_HINT") == ov.Type.f32
    assert compiled.get_property("NUM_STREAMS") == 1


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("NUM_STREAMS", "many", "expected AUTO, NUMA or a count, got 'many'"),
        ("INFERENCE_NUM_THREADS", "-1", "expected a non-negative number, got '-1'"),
        (
            "PERFORMANCE_HINT",
            "fast",
            "expected LATENCY, THROUGHPUT, CUMULATIVE_THROUGHPUT, got 'fast'",
        ),
        ("HINT_BF16", "no", "expected YES, got 'no'"),
        ("TARGET_DEVICE", "gpu", "'GPU': sluice runs OpenVINO on CPU only"),
    ],
)
def test_a_bad_parameter_is_named_in_the_error(
    tmp_path: Path, key: str, value: str, message: str
) -> None:
    model_dir = _with_parameters(tmp_path, "bad", **{key: value})
    assert load_error(model_dir) == f"{model_dir / 'config.pbtxt'}: parameters.{key}: {message}"


# -- the config against the model ----------------------------------------------------------


def test_config_errors_are_tritons(tmp_path: Path) -> None:
    cases = {
        "named": (
            DENSE_CONFIG.replace('"x"', '"z"'),
            "unexpected inference input 'z', allowed inputs are: x",
        ),
        "out": (
            DENSE_CONFIG.replace('"top"', '"best"'),
            "unexpected inference output 'best', allowed outputs are: top, y",
        ),
        "two": (
            DENSE_CONFIG.replace(
                "input [ {", 'input [ { name: "w" data_type: TYPE_FP32 dims: [ 4 ] }, {'
            ),
            "unable to load model 'two', configuration expects 2 inputs, model provides 1",
        ),
        "wide": (
            DENSE_CONFIG.replace("dims: [ 4 ]", "dims: [ 5 ]"),
            "model 'wide', tensor 'x': the model expects 2 dimensions (shape [-1,4]) but the "
            "model configuration specifies 2 dimensions (an initial batch dimension because "
            "max_batch_size > 0 followed by the explicit tensor shape, making complete shape "
            "[8,5])",
        ),
        "text": (
            DENSE_CONFIG.replace("TYPE_FP32 dims: [ 4 ]", "TYPE_STRING dims: [ 4 ]"),
            "unsupported datatype TYPE_STRING for input 'x' for model 'text'",
        ),
        "gpu": (
            DENSE_CONFIG + "instance_group [ { kind: KIND_GPU } ]",
            "unable to load model 'gpu', the OpenVINO backend supports only Kind CPU and AUTO",
        ),
    }
    for name, (config, message) in cases.items():
        assert load_error(write_model(tmp_path, name, dense_graph(), config)) == message


def test_a_file_openvino_cannot_read_is_named(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "garbled", dense_graph(), DENSE_CONFIG)
    (model_dir / "1" / "model.xml").write_text("<net>")
    assert load_error(model_dir).startswith(
        f"{model_dir / '1' / 'model.xml'}: cannot read OpenVINO model"
    )


# -- TensorRT without a GPU ----------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_a_tensorrt_plan_without_a_gpu_is_unavailable_with_the_reason(tmp_path: Path) -> None:
    """Auto-complete and loading both say what the model needs; the repository's other
    models scan as usual."""
    plan_dir = tmp_path / "engine"
    (plan_dir / "1").mkdir(parents=True)
    (plan_dir / "1" / "model.plan").write_bytes(b"not an engine")
    (plan_dir / "config.pbtxt").write_text('platform: "tensorrt_plan"\n')
    write_model(tmp_path, "dense", dense_graph(), DENSE_CONFIG)
    reason = (
        "model 'engine' needs an NVIDIA GPU and the tensorrt package "
        "(pip install 'sluice-serve[tensorrt]'): no CUDA device is present"
    )
    entries = {e.name: e for e in scan_repository(tmp_path, complete=complete_config)}
    assert (entries["engine"].spec, entries["engine"].error) == (None, reason)
    assert entries["dense"].error is None
    (plan_dir / "config.pbtxt").write_text('platform: "tensorrt_plan"\n' + DENSE_CONFIG)
    spec = load_model_config(plan_dir)
    assert (spec.kind, spec.backend, spec.model_filename) == ("tensorrt", "tensorrt", "model.plan")
    with pytest.raises(ModelConfigError, match=r"needs an NVIDIA GPU") as err:
        load_function(spec, plan_dir, 1, choose_device(spec), 0)
    assert err.value.message == reason


# -- the example ---------------------------------------------------------------------------


def test_the_example_mlp_openvino_is_the_reference_mlp(tmp_path: Path) -> None:
    """examples/build_models.py converts mlp_onnx's export of `mlp`'s weights: mlp_openvino,
    under its committed config, answers as the reference MLP does."""
    builders = runpy.run_path(str(EXAMPLES / "build_models.py"))
    model_dir = tmp_path / "mlp_openvino"
    (model_dir / "1").mkdir(parents=True)
    shutil.copy(EXAMPLES / "model_repository" / "mlp_openvino" / "config.pbtxt", model_dir)
    builders["build_mlp_openvino"](model_dir / "1")
    assert sorted(p.name for p in (model_dir / "1").iterdir()) == ["model.bin", "model.xml"]
    x = torch.randn(3, 512)
    out = model_instance(model_dir)({"INPUT__0": x})["OUTPUT__0"]
    with torch.no_grad():
        np.testing.assert_allclose(out, builders["reference_mlp"]()(x).numpy(), atol=1e-5)
