"""config.pbtxt parsing, validation and Triton-style normalisation (no torch, no Redis)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import ModelSpec, load_model_config

IO = """
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def write_config(tmp_path: Path, text: str, name: str = "m") -> Path:
    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.pbtxt").write_text(text)
    return model_dir


def load(tmp_path: Path, text: str, name: str = "m") -> ModelSpec:
    return load_model_config(write_config(tmp_path, text, name))


def config_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ModelConfigError) as info:
        load(tmp_path, text)
    message = info.value.message
    assert str(tmp_path / "m" / "config.pbtxt") in message
    return message


def test_defaults_are_normalised(tmp_path: Path) -> None:
    spec = load(tmp_path, 'platform: "pytorch_libtorch" max_batch_size: 8 dynamic_batching {}' + IO)
    assert spec.name == "m"
    assert spec.kind == "pytorch"
    assert (spec.platform, spec.backend) == ("pytorch_libtorch", "pytorch")
    assert spec.model_filename == "model.pt"
    assert spec.batching.dynamic
    assert spec.batching.preferred_batch_sizes == (8,)
    assert spec.batching.max_queue_delay_us == 0
    assert not spec.batching.preserve_ordering
    assert spec.batching.delay_mode is None  # the server's default, itself Triton's fixed wait
    assert spec.version_policy == ("latest", (1,))
    assert (spec.instance_count, spec.instance_kind) == (1, "KIND_AUTO")
    assert (spec.intra_op_threads, spec.inter_op_threads) == (None, None)
    assert spec.inputs[0].datatype == "FP32"
    assert spec.inputs[0].dims == (4,)
    assert spec.inputs[0].reshape is None


def test_without_dynamic_batching(tmp_path: Path) -> None:
    spec = load(tmp_path, 'backend: "pytorch" max_batch_size: 0' + IO)
    assert not spec.batching.dynamic
    assert spec.batching.preferred_batch_sizes == ()
    assert spec.max_batch_size == 0


def test_backend_pytorch_gets_platform_and_python_backend(tmp_path: Path) -> None:
    torch_spec = load(tmp_path, 'backend: "pytorch"' + IO, name="a")
    assert (torch_spec.platform, torch_spec.backend) == ("pytorch_libtorch", "pytorch")
    assert torch_spec.config_json["default_model_filename"] == "model.pt"
    python_spec = load(tmp_path, 'backend: "python"' + IO, name="b")
    assert (python_spec.kind, python_spec.platform, python_spec.backend) == (
        "python",
        "python",
        "python",
    )
    assert python_spec.model_filename == "model.py"
    alt = load(tmp_path, 'platform: "libtorch" default_model_filename: "net.pt"' + IO, name="c")
    assert (alt.kind, alt.platform, alt.model_filename) == ("pytorch", "libtorch", "net.pt")


def test_preferred_sizes_sorted_and_queue_fields_kept(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        'backend: "pytorch" max_batch_size: 32'
        + IO
        + """
        dynamic_batching {
          preferred_batch_size: [ 32, 8 ]
          max_queue_delay_microseconds: 500
          preserve_ordering: true
          default_queue_policy { timeout_action: DELAY max_queue_size: 7 }
        }
        """,
    )
    assert spec.batching.preferred_batch_sizes == (8, 32)
    assert spec.batching.max_queue_delay_us == 500
    assert spec.batching.preserve_ordering
    policy = spec.config_json["dynamic_batching"]["default_queue_policy"]
    assert (policy["timeout_action"], policy["max_queue_size"]) == ("DELAY", 7)


def test_reshape_and_variable_dims(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        """
        backend: "pytorch" max_batch_size: 4
        input [
          { name: "A" data_type: TYPE_FP32 dims: [ 2, 4 ] reshape { shape: [ 8 ] } },
          { name: "B" data_type: TYPE_INT64 dims: [ -1, 6 ] reshape { shape: [ -1, 2, 3 ] }
            allow_ragged_batch: true optional: true },
          { name: "C" data_type: TYPE_STRING dims: [ 1 ] reshape { shape: [ ] } }
        ]
        output [ { name: "Y" data_type: TYPE_FP16 dims: [ -1 ] } ]
        """,
    )
    a, b, c = spec.inputs
    assert a.reshape == (8,)
    assert (b.dims, b.reshape, b.allow_ragged_batch, b.optional) == (
        (-1, 6),
        (-1, 2, 3),
        True,
        True,
    )
    assert (c.datatype, c.reshape) == ("BYTES", ())
    assert spec.outputs[0].dims == (-1,)


def test_thread_count_parameters(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        'platform: "pytorch_libtorch"'
        + IO
        + """
        parameters { key: "INTRA_OP_THREAD_COUNT" value { string_value: "4" } }
        parameters { key: "INTER_OP_THREAD_COUNT" value { string_value: "0" } }
        parameters { key: "OTHER" value { string_value: "x" } }
        """,
    )
    assert spec.intra_op_threads == 4
    assert spec.inter_op_threads is None  # <= 0 keeps torch's default, as the backend does
    assert spec.parameters == {
        "INTRA_OP_THREAD_COUNT": "4",
        "INTER_OP_THREAD_COUNT": "0",
        "OTHER": "x",
    }


@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_batch_delay_parameter_is_the_model_s_own_choice(tmp_path: Path, mode: str) -> None:
    spec = load(
        tmp_path,
        'platform: "pytorch_libtorch" max_batch_size: 8 dynamic_batching {}'
        + IO
        + f'parameters {{ key: "BATCH_DELAY" value {{ string_value: "{mode}" }} }}',
    )
    assert spec.batching.delay_mode == mode


def test_instance_groups_are_summed(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        'backend: "pytorch"'
        + IO
        + "instance_group [ { count: 2 kind: KIND_CPU }, { kind: KIND_CPU name: 'extra' } ]",
    )
    assert (spec.instance_count, spec.instance_kind) == (3, "KIND_CPU")
    groups = spec.config_json["instance_group"]
    assert [(g["name"], g["count"]) for g in groups] == [("m_0", 2), ("extra", 1)]


def test_config_json_is_triton_shaped(tmp_path: Path) -> None:
    spec = load(
        tmp_path,
        """
        backend: "pytorch" max_batch_size: 16
        input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, 3 ] reshape { shape: [ -1, 3, 1 ] } } ]
        output [ { name: "Y" data_type: TYPE_INT64 dims: [ 10 ] label_filename: "labels.txt" } ]
        dynamic_batching {
          max_queue_delay_microseconds: 1000
          default_queue_policy { default_timeout_microseconds: 2500 }
        }
        version_policy { specific { versions: [ 3, 1 ] } }
        """,
    )
    cfg = spec.config_json
    json.dumps(cfg)  # plain JSON types only
    assert (cfg["name"], cfg["platform"], cfg["backend"]) == ("m", "pytorch_libtorch", "pytorch")
    assert cfg["max_batch_size"] == 16
    assert cfg["input"][0]["dims"] == [-1, 3]
    assert cfg["input"][0]["reshape"] == {"shape": [-1, 3, 1]}
    assert cfg["input"][0]["data_type"] == "TYPE_FP32"
    assert cfg["output"][0]["label_filename"] == "labels.txt"
    batching = cfg["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 1000
    assert batching["preferred_batch_size"] == [16]
    assert batching["default_queue_policy"]["default_timeout_microseconds"] == 2500
    assert batching["default_queue_policy"]["timeout_action"] == "REJECT"
    assert cfg["version_policy"] == {"specific": {"versions": [3, 1]}}
    assert cfg["instance_group"] == [
        {
            "name": "m",
            "kind": "KIND_AUTO",
            "count": 1,
            "gpus": [],
            "secondary_devices": [],
            "profile": [],
            "passive": False,
            "host_policy": "",
        }
    ]
    assert spec.version_policy == ("specific", (1, 3))


def test_version_policies(tmp_path: Path) -> None:
    latest = load(tmp_path, 'backend: "pytorch" version_policy { latest { num_versions: 2 } }' + IO)
    assert latest.version_policy == ("latest", (2,))
    every = load(tmp_path, 'backend: "pytorch" version_policy { all {} }' + IO, name="n")
    assert every.version_policy == ("all", ())
    assert every.config_json["version_policy"] == {"all": {}}


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    message = config_error(tmp_path, 'backend: "pytorch"\nmax_batch_size: "eight"\n' + IO)
    assert "config.pbtxt:2:" in message
    assert "max_batch_size" in message


def test_unknown_field_names_file_and_line(tmp_path: Path) -> None:
    message = config_error(tmp_path, 'backend: "pytorch"\nmax_batch: 4\n' + IO)
    assert "config.pbtxt:2:1" in message
    assert "max_batch" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            'backend: "pytorch" max_batch_size: 4 dynamic_batching { preferred_batch_size: [ 8 ] }',
            "dynamic_batching.preferred_batch_size: 8 must be > 0 and <= max_batch_size 4",
        ),
        (
            'backend: "pytorch" max_batch_size: 4 dynamic_batching { preferred_batch_size: [ 0 ] }',
            "dynamic_batching.preferred_batch_size: 0 must be > 0",
        ),
        (
            'backend: "pytorch" dynamic_batching { }',
            "dynamic_batching: requires max_batch_size > 0",
        ),
        ('backend: "pytorch" max_batch_size: -1', "max_batch_size: must be >= 0"),
        ('platform: "tensorflow_graphdef"', "platform: unsupported platform 'tensorflow_graphdef'"),
        ('backend: "dali"', "backend: unsupported backend 'dali'"),
        ('platform: "pytorch_libtorch" backend: "python"', "backend: backend 'python' does not"),
        ("max_batch_size: 4", "Could not determine backend for model"),
        ('name: "other" backend: "pytorch"', "name: 'other' must equal the directory name 'm'"),
        (
            'backend: "pytorch" instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU } ]',
            "instance_group[1].kind",
        ),
        (
            (
                'backend: "pytorch" parameters { key: "INTRA_OP_THREAD_COUNT" value '
                '{ string_value: "many" } }'
            ),
            "parameters.INTRA_OP_THREAD_COUNT: must be an integer, got 'many'",
        ),
        (
            'backend: "pytorch" parameters { key: "BATCH_DELAY" value { string_value: "soon" } }',
            "parameters.BATCH_DELAY: must be 'fixed' or 'adaptive', got 'soon'",
        ),
    ],
)
def test_invalid_configs(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in config_error(tmp_path, text + IO)


@pytest.mark.parametrize(
    ("io", "expected"),
    [
        ('input [ { name: "X" data_type: TYPE_FP32 dims: [ ] } ]', "input[0].dims: must not be"),
        ('input [ { name: "X" data_type: TYPE_FP32 dims: [ 2, -3 ] } ]', "input[0].dims: dimen"),
        ('input [ { name: "X" data_type: TYPE_FP32 dims: [ 0 ] } ]', "input[0].dims: dimensions"),
        ('input [ { name: "X" dims: [ 2 ] } ]', "input[0].data_type: must be set for 'X'"),
        ("input [ { data_type: TYPE_FP32 dims: [ 2 ] } ]", "input[0].name: must be set"),
        (
            'input [ { name: "X" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape { shape: [ 5 ] } } ]',
            "input[0].reshape.shape: [5] has a different element count than dims [2, 3]",
        ),
        (
            'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, 3 ] reshape { shape: [ 3 ] } } ]',
            "input[0].reshape.shape",
        ),
        (
            (
                'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] },'
                ' { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]'
            ),
            "input[1].name: duplicate input name 'X'",
        ),
        ("", "input: must list at least one tensor"),
    ],
)
def test_invalid_tensors(tmp_path: Path, io: str, expected: str) -> None:
    output = 'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    text = f'backend: "pytorch" max_batch_size: 2 {io} {output}'
    assert expected in config_error(tmp_path, text)


def test_missing_outputs(tmp_path: Path) -> None:
    text = 'backend: "pytorch" input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    assert "output: must list at least one tensor" in config_error(tmp_path, text)


def test_empty_reshape_needs_batching(tmp_path: Path) -> None:
    text = (
        'backend: "pytorch" input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] '
        "reshape { shape: [ ] } } ]"
        ' output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    )
    assert "input[0].reshape.shape: cannot be empty" in config_error(tmp_path, text)


def test_missing_config_file(tmp_path: Path) -> None:
    """Auto-completed as Triton's default: with no model file, no backend to fill it."""
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelConfigError, match="Could not determine backend for model"):
        load_model_config(tmp_path / "m")


@pytest.mark.parametrize("filename", ["../../../etc/model.pt", "/etc/model.pt", "..\\x.pt"])
def test_the_model_file_is_one_in_the_version_directory(tmp_path: Path, filename: str) -> None:
    """A load's config parameter comes from the wire: its model file cannot be elsewhere."""
    text = f'backend: "pytorch" default_model_filename: "{filename}"' + IO
    text = text.replace("\\", "\\\\")
    assert "default_model_filename: " in config_error(tmp_path, text)


def test_a_model_file_in_a_subdirectory_of_the_version_is_kept(tmp_path: Path) -> None:
    text = 'backend: "pytorch" default_model_filename: "saved/model.pt"' + IO
    assert load(tmp_path, text).model_filename == "saved/model.pt"
