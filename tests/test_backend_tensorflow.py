"""The TensorFlow backend on its own: Triton's auto-complete from the serving signature, the
config checked against the signature with Triton's messages, the signature and graph tag
parameters, thread pools sized as torch's, and results equal to Keras's own on the same rows.
SavedModels are built here with Keras and tf.Module."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch
from sluice.shared.repository import scan_repository
from sluice.workers.backends import choose_device, complete_config, load_function

from tests.backend_models import load_error, model_instance, model_spec, run_script

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def linear_model() -> keras.Model:
    """x [batch, 4] FP32 -> y = dense(x) [batch, 3] FP32 and label = argmax(y) [batch] INT32."""
    keras.utils.set_random_seed(0)
    x = keras.Input(shape=(4,), name="x")
    y = keras.layers.Dense(3)(x)
    return keras.Model(x, {"y": y, "label": keras.ops.argmax(y, axis=1)})


class AddSub(tf.Module):
    """Two signatures over a, b [N, 2]: `serving_default` adds, `subtract` subtracts."""

    pair = (
        tf.TensorSpec([None, 2], tf.float32, name="a"),
        tf.TensorSpec([None, 2], tf.float32, name="b"),
    )

    @tf.function(input_signature=pair)
    def add(self, a: Any, b: Any) -> dict[str, Any]:
        return {"sum": a + b}

    @tf.function(input_signature=pair)
    def subtract(self, a: Any, b: Any) -> dict[str, Any]:
        return {"diff": a - b}


class Echo(tf.Module):
    """text [N, 1] strings -> echo: each string with "!" after it."""

    @tf.function(input_signature=(tf.TensorSpec([None, 1], tf.string, name="text"),))
    def echo(self, text: Any) -> dict[str, Any]:
        return {"echo": tf.strings.join([text, "!"])}


def save_add_sub(path: Path, signatures: tuple[str, ...] = ("serving_default", "subtract")) -> None:
    module = AddSub()
    functions = {"serving_default": module.add, "subtract": module.subtract}
    tf.saved_model.save(module, str(path), signatures={k: functions[k] for k in signatures})


def save_echo(path: Path) -> None:
    module = Echo()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.echo})


def save_fixed(model: keras.Model, path: Path, batch: int) -> None:
    """`model` served with a fixed first dim of `batch` (Keras's export always makes it -1)."""
    module = tf.Module()
    module.model = model
    spec = tf.TensorSpec([batch, 4], tf.float32, name="x")
    serve = tf.function(lambda x: model(x), input_signature=[spec])
    tf.saved_model.save(module, str(path), signatures={"serving_default": serve})


def write_model(
    repo: Path, name: str, model: keras.Model | None, config: str = "", *, batch: int = 0
) -> Path:
    """`<repo>/<name>/1/model.savedmodel` (Keras's export of `model`, with a fixed first dim
    if `batch`; None: the caller saves it) and a config.pbtxt of
    `platform: "tensorflow_savedmodel"` plus `config`."""
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True)
    path = model_dir / "1" / "model.savedmodel"
    if model is not None and batch:
        save_fixed(model, path, batch)
    elif model is not None:
        model.export(str(path), verbose=False)
    (model_dir / "config.pbtxt").write_text(f'platform: "tensorflow_savedmodel"\n{config}\n')
    return model_dir


LINEAR_CONFIG = """
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "y" data_type: TYPE_FP32 dims: [ 3 ] },
  { name: "label" data_type: TYPE_INT32 dims: [ 1 ] reshape { shape: [] } }
]
"""


@pytest.fixture(scope="module")
def linear() -> keras.Model:
    return linear_model()


# -- auto-complete -------------------------------------------------------------------------


def test_a_config_without_tensors_is_completed_from_the_signature(
    tmp_path: Path, linear: keras.Model
) -> None:
    """Every tensor's first dim is -1: batching, max_batch_size 4, dynamic batching, dims
    without the batch dim, a [batch] tensor as dims [1] reshaped to [], names the keys."""
    spec = model_spec(write_model(tmp_path, "auto", linear))
    assert (spec.max_batch_size, spec.batching.dynamic) == (4, True)
    assert [(t.name, t.datatype, t.dims, t.reshape) for t in spec.inputs] == [
        ("x", "FP32", (4,), None)
    ]
    assert [(t.name, t.datatype, t.dims, t.reshape) for t in spec.outputs] == [
        ("label", "INT32", (1,), ()),
        ("y", "FP32", (3,), None),
    ]


def test_a_savedmodel_without_config_pbtxt_is_found_and_completed(
    tmp_path: Path, linear: keras.Model
) -> None:
    """Triton's autofill: a `model.savedmodel` folder makes it a TensorFlow model."""
    model_dir = write_model(tmp_path, "bare", linear)
    (model_dir / "config.pbtxt").unlink()
    spec = model_spec(model_dir)
    assert (spec.kind, spec.platform, spec.max_batch_size) == (
        "tensorflow",
        "tensorflow_savedmodel",
        4,
    )
    assert [t.name for t in spec.inputs] == ["x"]


def test_auto_complete_keeps_the_configs_batching(tmp_path: Path, linear: keras.Model) -> None:
    big = model_spec(write_model(tmp_path, "big", linear, "max_batch_size: 16"))
    assert (big.max_batch_size, big.batching.dynamic) == (16, True)
    one = model_spec(write_model(tmp_path, "one", linear, "max_batch_size: 1"))
    assert (one.max_batch_size, one.batching.dynamic) == (1, False)


def test_tensors_listed_without_max_batch_size_hint_at_batching(
    tmp_path: Path, linear: keras.Model
) -> None:
    """As Triton's TF backend, auto-complete runs on a config listing its tensors too: dims one
    shorter than the signature's rank mean batching (max_batch_size 4); dims of its full rank
    mean none."""
    listed = LINEAR_CONFIG.replace("max_batch_size: 8", "")
    batching = model_spec(write_model(tmp_path, "batching", linear, listed))
    assert (batching.max_batch_size, batching.batching.dynamic) == (4, True)
    full = listed.replace("dims: [ 4 ]", "dims: [ -1, 4 ]")
    full = full.replace("dims: [ 3 ]", "dims: [ -1, 3 ]")
    full = full.replace("dims: [ 1 ] reshape { shape: [] }", "dims: [ -1 ]")
    flat = model_spec(write_model(tmp_path, "flat", linear, full))
    assert (flat.max_batch_size, flat.batching.dynamic) == (0, False)
    x = torch.randn(2, 4)
    out = load_function(flat, tmp_path / "flat", 1, choose_device(flat), 0)({"x": x})
    np.testing.assert_array_equal(out["y"], linear(x.numpy())["y"])


def test_a_signature_with_a_fixed_first_dim_does_not_batch(
    tmp_path: Path, linear: keras.Model
) -> None:
    spec = model_spec(write_model(tmp_path, "fixed", linear, batch=2))
    assert (spec.max_batch_size, spec.batching.dynamic) == (0, False)
    assert spec.inputs[0].dims == (2, 4)
    assert [t.dims for t in spec.outputs] == [(2,), (2, 3)]


def test_max_batch_size_on_a_signature_that_cannot_batch_is_tritons_autofill_error(
    tmp_path: Path, linear: keras.Model
) -> None:
    write_model(tmp_path, "fixed", linear, "max_batch_size: 8", batch=2)
    entry = scan_repository(tmp_path, complete=complete_config)[0]
    assert entry.spec is None
    assert entry.error == (
        "unable to autofill for 'fixed', configuration specified max-batch 8 but model "
        "signature does not support batching"
    )


# -- running ---------------------------------------------------------------------------------


def test_answers_equal_keras_on_the_same_rows(tmp_path: Path, linear: keras.Model) -> None:
    infer = model_instance(write_model(tmp_path, "declared", linear, LINEAR_CONFIG))
    x = torch.randn(5, 4)
    out = infer({"x": x})
    expected = linear(x.numpy())
    np.testing.assert_array_equal(out["y"], expected["y"])
    np.testing.assert_array_equal(out["label"], expected["label"])
    assert isinstance(out["y"], np.ndarray) and out["y"].dtype == np.float32


def test_inputs_tensorflow_cannot_read_in_place_are_copied(
    tmp_path: Path, linear: keras.Model
) -> None:
    """A view 4 bytes off TensorFlow's alignment, and a transposed one, answer as a dense
    copy of the same rows does (TensorFlow would abort on the misaligned one)."""
    infer = model_instance(write_model(tmp_path, "declared", linear, LINEAR_CONFIG))
    rows = torch.randn(6, 4)
    offset = torch.cat([torch.zeros(1), rows.reshape(-1)])[1:].reshape(6, 4)
    transposed = rows.t().contiguous().t()
    assert offset.data_ptr() % 64 != 0 and not transposed.is_contiguous()
    expected = infer({"x": rows.clone()})["y"]
    np.testing.assert_array_equal(infer({"x": offset})["y"], expected)
    np.testing.assert_array_equal(infer({"x": transposed})["y"], expected)


def test_strings_round_trip(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "echo", None)
    save_echo(model_dir / "1" / "model.savedmodel")
    spec = model_spec(model_dir)
    assert [(t.name, t.datatype) for t in (*spec.inputs, *spec.outputs)] == [
        ("text", "BYTES"),
        ("echo", "BYTES"),
    ]
    text = np.array([[b"hello"], ["wörld".encode()]], dtype=np.object_)
    out = load_function(spec, model_dir, 1, choose_device(spec), 0)({"text": text})
    assert out["echo"].tolist() == [[b"hello!"], ["wörld!".encode()]]


def test_the_signature_parameter_picks_another_signature(tmp_path: Path) -> None:
    model_dir = write_model(
        tmp_path,
        "sub",
        None,
        'parameters { key: "TF_SIGNATURE_DEF" value { string_value: "subtract" } }',
    )
    save_add_sub(model_dir / "1" / "model.savedmodel")
    spec = model_spec(model_dir)
    assert [o.name for o in spec.outputs] == ["diff"]
    a, b = torch.randn(3, 2), torch.randn(3, 2)
    out = load_function(spec, model_dir, 1, choose_device(spec), 0)({"a": a, "b": b})
    np.testing.assert_allclose(out["diff"], (a - b).numpy(), rtol=1e-6)


def test_without_serving_default_the_other_signature_serves_as_in_triton(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "only_sub", None)
    save_add_sub(model_dir / "1" / "model.savedmodel", signatures=("subtract",))
    assert [o.name for o in model_spec(model_dir).outputs] == ["diff"]


def test_a_missing_graph_tag_is_refused(tmp_path: Path, linear: keras.Model) -> None:
    config = 'parameters { key: "TF_GRAPH_TAG" value { string_value: "train" } }'
    write_model(tmp_path, "tagged", linear, config)
    assert scan_repository(tmp_path, complete=complete_config)[0].error == (
        "unable to load model 'tagged', expected 'train' tag"
    )


# -- the config against the signature ---------------------------------------------------------


def test_config_names_are_the_signatures_keys_not_its_tensor_names(
    tmp_path: Path, linear: keras.Model
) -> None:
    config = LINEAR_CONFIG.replace('name: "x"', 'name: "serving_default_x:0"')
    assert load_error(write_model(tmp_path, "m", linear, config)) == (
        "unexpected inference input 'serving_default_x:0', allowed inputs are: x"
    )


def test_a_wrong_data_type_is_tritons_error(tmp_path: Path, linear: keras.Model) -> None:
    config = LINEAR_CONFIG.replace("TYPE_FP32 dims: [ 4 ]", "TYPE_FP16 dims: [ 4 ]")
    assert load_error(write_model(tmp_path, "m", linear, config)) == (
        "unable to load model 'm', configuration expects datatype TYPE_FP16 for input 'x', "
        "model provides TYPE_FP32"
    )
    config = LINEAR_CONFIG.replace("TYPE_INT32", "TYPE_INT64")
    assert load_error(write_model(tmp_path, "n", linear, config)) == (
        "unable to load model 'n', configuration expects datatype TYPE_INT64 for output "
        "'label', model provides TYPE_INT32"
    )


def test_wrong_dims_and_counts_are_tritons_errors(tmp_path: Path, linear: keras.Model) -> None:
    config = LINEAR_CONFIG.replace("dims: [ 4 ]", "dims: [ 5 ]")
    assert load_error(write_model(tmp_path, "dims", linear, config)) == (
        "model 'dims', tensor 'x': the model expects 2 dimensions (shape [-1,4]) but the model "
        "configuration specifies 2 dimensions (an initial batch dimension because "
        "max_batch_size > 0 followed by the explicit tensor shape, making complete shape [-1,5])"
    )
    extra = LINEAR_CONFIG.replace(
        "input [", 'input [ { name: "z" data_type: TYPE_FP32 dims: [ 1 ] },'
    )
    assert load_error(write_model(tmp_path, "extra", linear, extra)) == (
        "unable to load model 'extra', configuration expects 2 inputs, model provides 1"
    )
    fixed = LINEAR_CONFIG.replace("max_batch_size: 8", "max_batch_size: 0")
    fixed = fixed.replace(" reshape { shape: [] }", "")
    assert "(shape [2,4]) but the model configuration specifies 1 dimensions (shape [4])" in (
        load_error(write_model(tmp_path, "unbatched", linear, fixed, batch=2))
    )


def test_unsupported_types_and_bad_thread_counts_are_refused(
    tmp_path: Path, linear: keras.Model
) -> None:
    config = LINEAR_CONFIG.replace("TYPE_FP32 dims: [ 4 ]", "TYPE_BF16 dims: [ 4 ]")
    assert load_error(write_model(tmp_path, "bf16", linear, config)) == (
        "unsupported datatype 'TYPE_BF16' for tensor 'x' for model 'bf16'"
    )
    threads = 'parameters { key: "TF_NUM_INTRA_THREADS" value { string_value: "-1" } }'
    assert load_error(write_model(tmp_path, "threads", linear, LINEAR_CONFIG + threads)) == (
        "parameter 'TF_NUM_INTRA_THREADS' must be non-negative number for TensorFlow model "
        "'threads'"
    )


# -- threads -------------------------------------------------------------------------------

_THREADS_SCRIPT = """
import json, sys
from pathlib import Path
import tensorflow as tf
from sluice.shared.repository import scan_repository
from sluice.workers.backends import complete_config
from sluice.workers.models.model_build import configure_threads, load_model

entries = {e.name: e for e in scan_repository(Path(sys.argv[1]), complete=complete_config)}
configure_threads(list(entries.values()))
seen = []
for name in ("first", "second"):
    load_model(entries[name])
    threading = tf.config.threading
    seen.append([threading.get_intra_op_parallelism_threads(),
                 threading.get_inter_op_parallelism_threads()])
print(json.dumps(seen))
"""


def test_tensorflow_threads_follow_the_workers_torch_threads(
    tmp_path: Path, linear: keras.Model
) -> None:
    """In a fresh worker process, TensorFlow's pools get the torch thread counts the worker
    set from INTRA/INTER_OP_THREAD_COUNT; a later model cannot change them."""
    torch_threads = """
parameters { key: "INTRA_OP_THREAD_COUNT" value { string_value: "1" } }
parameters { key: "INTER_OP_THREAD_COUNT" value { string_value: "1" } }
"""
    write_model(tmp_path, "first", linear, LINEAR_CONFIG + torch_threads)
    own = 'parameters { key: "TF_NUM_INTRA_THREADS" value { string_value: "2" } }'
    write_model(tmp_path, "second", linear, LINEAR_CONFIG + own)
    done = run_script(_THREADS_SCRIPT, str(tmp_path))
    done.check_returncode()
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[1, 1], [1, 1]]
    assert "TensorFlow already runs 1 intra-op and 1 inter-op threads" in done.stderr


# -- the example ---------------------------------------------------------------------------


def test_the_example_mlp_tf_is_the_reference_mlp(tmp_path: Path) -> None:
    """examples/build_models.py exports `mlp`'s weights: mlp_tf, under its committed config,
    answers as the reference MLP does."""
    builders = runpy.run_path(str(EXAMPLES / "build_models.py"))
    model_dir = tmp_path / "mlp_tf"
    (model_dir / "1").mkdir(parents=True)
    shutil.copy(EXAMPLES / "model_repository" / "mlp_tf" / "config.pbtxt", model_dir)
    builders["build_mlp_tf"](model_dir / "1")
    x = torch.randn(3, 512)
    out = model_instance(model_dir)({"INPUT__0": x})["OUTPUT__0"]
    with torch.no_grad():
        np.testing.assert_allclose(out, builders["reference_mlp"]()(x).numpy(), atol=1e-5)
