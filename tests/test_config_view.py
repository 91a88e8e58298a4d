"""The typed view of a model's config: the fields gateways and workers read (no Redis)."""

from __future__ import annotations

from pathlib import Path

from sluice.shared.config_view import ConfigView
from sluice.shared.registry import ModelRecord, encode_model_record
from sluice.shared.signature import IOSpec

from tests.test_model_config import IO, load

BATCHING = """
backend: "python"
max_batch_size: 8
dynamic_batching {
  preserve_ordering: true
  priority_levels: 2
  default_priority_level: 2
  default_queue_policy { max_queue_size: 5 }
}
model_transaction_policy { decoupled: true }
parameters { key: "PARTITIONS" value: { string_value: "3" } }
"""

ENSEMBLE = """
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    { model_name: "a" input_map { key: "x" value: "IN" } output_map { key: "y" value: "MID" } },
    { model_name: "b" input_map { key: "x" value: "MID" } output_map { key: "y" value: "OUT" } },
    { model_name: "a" input_map { key: "x" value: "IN" } output_map { key: "y" value: "T" } }
  ]
}
"""


def test_a_loaded_config_is_read_once_into_typed_fields(tmp_path: Path) -> None:
    spec = load(tmp_path, BATCHING + IO)
    view = spec.config
    assert (view.name, view.platform, view.backend, view.max_batch_size) == ("m", "", "python", 8)
    assert view.signature.inputs == (IOSpec("INPUT__0", "FP32", (4,)),)
    assert view.signature.output_names() == ("OUTPUT__0",)
    assert view.queue_policy.levels == (1, 2)
    assert view.queue_policy.default_priority_level == 2
    assert view.queue_policy.for_level(1).max_queue_size == 5
    assert view.preserve_ordering and view.decoupled
    assert not view.iterative_sequence and not view.is_ensemble
    assert view.partitions == spec.partitions == 3
    assert view.ensemble_steps == ()
    assert spec.config_json is view.json and view.json["name"] == "m"


def test_defaults_of_a_plain_config(tmp_path: Path) -> None:
    view = load(tmp_path, 'backend: "pytorch" max_batch_size: 0' + IO).config
    assert (view.platform, view.backend) == ("pytorch_libtorch", "pytorch")
    assert view.queue_policy.levels == (0,)
    assert not (view.preserve_ordering or view.decoupled or view.iterative_sequence)
    assert view.partitions == 1


def test_an_iterative_sequence_model(tmp_path: Path) -> None:
    text = 'backend: "python" sequence_batching { iterative_sequence: true }' + IO
    assert load(tmp_path, text).config.iterative_sequence


def test_an_ensemble_names_its_steps_models_once_each(tmp_path: Path) -> None:
    view = load(tmp_path, ENSEMBLE, name="e").config
    assert view.is_ensemble and view.backend == ""
    assert view.ensemble_steps == ("a", "b")


def test_a_record_decodes_its_config_into_a_view() -> None:
    config = {"name": "m", "platform": "ensemble", "max_batch_size": 4, "input": []}
    record = ModelRecord.decode(encode_model_record(config, [1, 3], None))
    assert record.config == ConfigView.from_json(config)
    assert record.config.is_ensemble and record.config.max_batch_size == 4
    assert (record.versions, record.error) == ([1, 3], None)
    failed = ModelRecord.decode(encode_model_record(None, [], "bad config"))
    assert (failed.config, failed.versions, failed.error) == (None, [], "bad config")
