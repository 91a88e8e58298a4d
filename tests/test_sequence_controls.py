"""Triton's sequence control inputs, from a config as Triton's JSON to the tensors a request
of a sequence gets (typed and shaped as tritonserver gives them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import load_model_config
from sluice.shared.sequence_controls import Flags, SequenceControl

CONFIG = """
name: "seq"
backend: "python"
max_batch_size: {batch}
input [ {{ name: "IN", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
sequence_batching {{
  control_input [
    {{ name: "S", control [ {{ kind: CONTROL_SEQUENCE_START, int32_false_true: [ 5, 7 ] }} ] }},
    {{ name: "E", control [ {{ kind: CONTROL_SEQUENCE_END, fp32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "R",
      control [ {{ kind: CONTROL_SEQUENCE_READY, bool_false_true: [ false, true ] }} ] }},
    {{ name: "C", control [ {{ kind: CONTROL_SEQUENCE_CORRID, data_type: {corrid} }} ] }}
  ]
}}
"""


def controls(
    tmp_path: Path, batch: int = 4, corrid: str = "TYPE_UINT64"
) -> dict[str, SequenceControl]:
    (tmp_path / "seq").mkdir()
    (tmp_path / "seq" / "config.pbtxt").write_text(CONFIG.format(batch=batch, corrid=corrid))
    spec = load_model_config(tmp_path / "seq")
    return {c.name: c for c in spec.config.sequence_controls}


def test_flags_take_the_configs_values_and_types(tmp_path: Path) -> None:
    found = controls(tmp_path)
    first = Flags(9, start=True)
    arrays = {name: c.array(first, batched=True) for name, c in found.items()}
    assert {n: (a.dtype.name, a.shape, a.tolist()) for n, a in arrays.items()} == {
        "S": ("int32", (1, 1), [[7]]),
        "E": ("float32", (1, 1), [[0.0]]),
        "R": ("bool", (1, 1), [[True]]),
        "C": ("uint64", (1, 1), [[9]]),
    }
    later = found["S"].array(Flags(9), batched=True)
    assert later.tolist() == [[5]]


def test_a_model_that_does_not_batch_gets_one_element_and_a_string_id_as_bytes(
    tmp_path: Path,
) -> None:
    found = controls(tmp_path, batch=0, corrid="TYPE_STRING")
    corrid = found["C"].array(Flags("session-1"), batched=False)
    assert corrid.shape == (1,) and corrid.dtype == np.object_
    assert corrid.tolist() == [b"session-1"]
    assert found["R"].array(Flags(1, ready=False), batched=False).tolist() == [False]


def test_a_sequence_model_without_an_idle_time_gets_tritons(tmp_path: Path) -> None:
    """tritonserver 2.51's config for such a model says 1000000 (its default), not 0."""
    controls(tmp_path)
    sequencing = load_model_config(tmp_path / "seq").config_json["sequence_batching"]
    assert sequencing["max_sequence_idle_microseconds"] == 1_000_000
    set_idle = CONFIG.format(batch=4, corrid="TYPE_UINT64").replace(
        "sequence_batching {", "sequence_batching { max_sequence_idle_microseconds: 5000"
    )
    (tmp_path / "seq" / "config.pbtxt").write_text(set_idle)
    sequencing = load_model_config(tmp_path / "seq").config_json["sequence_batching"]
    assert sequencing["max_sequence_idle_microseconds"] == 5000


START_BOTH = (
    'name: "START", control [ { kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ], '
    "fp32_false_true: [ 0, 1 ] } ]"
)
FLAGS = "'int32_false_true', 'fp32_false_true'"


@pytest.mark.parametrize(
    ("control_inputs", "message"),
    [
        (
            f"{{ {START_BOTH} }}",
            f"specifies more than one from {FLAGS} and 'bool_false_true' for "
            "CONTROL_SEQUENCE_START for seq",
        ),
        (
            '{ name: "S", control [ { kind: CONTROL_SEQUENCE_START, '
            "int32_false_true: [ 0, 1, 2 ] } ] }",
            "control 'int32_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_START "
            "for seq",
        ),
        (
            '{ name: "C", control [ { kind: CONTROL_SEQUENCE_CORRID, data_type: TYPE_UINT64, '
            "int32_false_true: [ 0, 1 ] } ] }",
            f"must not specify either {FLAGS} or 'bool_false_true' for CONTROL_SEQUENCE_CORRID "
            "for seq",
        ),
        (
            '{ name: "A", control [ { kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ] } ]'
            ' }, { name: "B", control [ { kind: CONTROL_SEQUENCE_START, '
            "int32_false_true: [ 0, 1 ] } ] }",
            "specifies multiple CONTROL_SEQUENCE_START tensors for seq",
        ),
        (
            '{ name: "S", control [ { kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ] } ]'
            ' }, { name: "S", control [ { kind: CONTROL_SEQUENCE_READY, '
            "int32_false_true: [ 0, 1 ] } ] }",
            "control tensor 'S' is specified for multiple control kinds for seq",
        ),
        (
            '{ name: "S", control [ { kind: CONTROL_SEQUENCE_START } ] }',
            f"must specify either {FLAGS} or 'bool_false_true' for CONTROL_SEQUENCE_START for seq",
        ),
        (
            "{ control [ { kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ] } ] }",
            "control tensor must have a name for seq",
        ),
    ],
)
def test_bad_control_inputs_fail_the_load_with_tritons_reason(
    tmp_path: Path, control_inputs: str, message: str
) -> None:
    """tritonserver 2.51 refused each of these with the same reason, word for word."""
    (tmp_path / "seq").mkdir()
    text = CONFIG.format(batch=4, corrid="TYPE_UINT64")
    start = text.index("  control_input [")
    end = text.index("  ]\n}", start) + len("  ]\n")
    (tmp_path / "seq" / "config.pbtxt").write_text(
        text[:start] + f"  control_input [ {control_inputs} ]\n" + text[end:]
    )
    with pytest.raises(ModelConfigError) as err:
        load_model_config(tmp_path / "seq")
    assert err.value.message == f"sequence batching {message}"
