"""Python models' own metrics (pb_utils.MetricFamily / Metric): Triton 2.51's behaviour and
error texts in a worker, the per-model caps, and the gateway's fleet-wide families."""

from __future__ import annotations

import gc
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from sluice.gateway.custom_families import custom_families
from sluice.gateway.triton_exposition import write
from sluice.shared.custom_metrics import INFO_KEY, MAX_FAMILIES_PER_MODEL, MAX_SERIES_PER_MODEL
from sluice.shared.model_config import load_model_config
from sluice.shared.registry import Member
from sluice.workers.backends import complete_config, load_instance
from sluice.workers.python_backend import pb_utils
from sluice.workers.python_backend.custom_metrics import REGISTRY, Registry
from sluice.workers.python_backend.instance import TritonInstance

from tests.conftest import HERE

MetricFamily = pb_utils.MetricFamily
TritonModelException = pb_utils.TritonModelException


def _reported(name: str) -> dict[str, Any] | None:
    return next((f for f in REGISTRY.snapshot() if f["name"] == name), None)


def test_a_counter_adds_up_and_refuses_to_go_down() -> None:
    family = MetricFamily("t_requests", "Requests seen", MetricFamily.COUNTER)
    metric = family.Metric(labels={"model": "m", "version": "1"})
    metric.increment(2)
    metric.increment(0.5)
    assert metric.value() == 2.5
    with pytest.raises(TritonModelException) as err:
        metric.increment(-1)
    assert str(err.value) == (
        "Failed to increment metric value: TRITONSERVER_METRIC_KIND_COUNTER can only be "
        "incremented monotonically by non-negative values."
    )
    with pytest.raises(TritonModelException, match="KIND_COUNTER does not support Set"):
        metric.set(1)
    with pytest.raises(TritonModelException, match="KIND_COUNTER does not support Observe"):
        metric.observe(1)
    reported = _reported("t_requests")
    assert reported is not None
    assert (reported["kind"], reported["help"]) == ("counter", "Requests seen")
    ((labels, value, _at),) = reported["series"]
    assert (labels, value) == ({"model": "m", "version": "1"}, 2.5)


def test_a_gauge_is_set_and_moves_both_ways() -> None:
    family = MetricFamily("t_queue", "Queue", MetricFamily.GAUGE)
    metric = family.Metric()
    metric.set(10)
    metric.increment(-4)
    assert metric.value() == 6
    with pytest.raises(TritonModelException) as err:
        metric.observe(1)
    assert str(err.value) == (
        "Failed to observe metric value: TRITONSERVER_METRIC_KIND_GAUGE does not support Observe"
    )


def test_a_histogram_counts_each_bucket_upper_inclusive() -> None:
    family = MetricFamily("t_latency", "Latency", MetricFamily.HISTOGRAM)
    metric = family.Metric(labels={"m": "x"}, buckets=[1.0, 2.0])
    for value in (0.5, 1.0, 1.5, 7.0):
        metric.observe(value)
    with pytest.raises(TritonModelException, match="KIND_HISTOGRAM does not support Value"):
        metric.value()
    with pytest.raises(TritonModelException, match="KIND_HISTOGRAM does not support Increment"):
        metric.increment(1)
    reported = _reported("t_latency")
    assert reported is not None
    ((_labels, histogram, _at),) = reported["series"]
    assert histogram == {"bounds": [1.0, 2.0], "counts": [2, 1, 1], "sum": 10.0}


@pytest.mark.parametrize(
    ("kind", "labels", "buckets", "message"),
    [
        (MetricFamily.HISTOGRAM, None, None, "Failed to create metric. Missing required buckets."),
        (MetricFamily.COUNTER, None, [1.0], "Failed to create metric. Unexpected buckets found."),
        (MetricFamily.HISTOGRAM, None, (1.0,), "Failed to create metric. Buckets must be a list."),
        (MetricFamily.GAUGE, ["a"], None, "Failed to create metric. Labels must be a dictionary."),
        (MetricFamily.HISTOGRAM, None, [2.0, 1.0], "Bucket Boundaries must be strictly sorted"),
        (MetricFamily.GAUGE, {"a": 1}, None, "label names and values must be strings"),
        (MetricFamily.GAUGE, {"bad-name": "x"}, None, "Invalid label name 'bad-name'"),
    ],
)
def test_a_bad_metric_is_tritons_error(kind: Any, labels: Any, buckets: Any, message: str) -> None:
    family = MetricFamily("t_bad", "Bad", kind)
    with pytest.raises(TritonModelException, match=message.replace(".", r"\.")):
        family.Metric(labels=labels, buckets=buckets)


def test_one_name_is_one_family_and_one_label_set_one_series() -> None:
    first = MetricFamily("t_shared", "First description", MetricFamily.COUNTER)
    second = MetricFamily("t_shared", "Second description", MetricFamily.COUNTER)
    first.Metric(labels={"a": "1"}).increment(1)
    second.Metric(labels={"a": "1"}).increment(2)
    assert second.Metric(labels={"a": "1"}).value() == 3
    reported = _reported("t_shared")
    assert reported is not None
    assert reported["help"] == "First description"
    with pytest.raises(TritonModelException, match="Family name already exists with different"):
        MetricFamily("t_shared", "Other kind", MetricFamily.GAUGE)
    with pytest.raises(TritonModelException, match="Invalid metric name"):
        MetricFamily("t shared", "Spaces", MetricFamily.GAUGE)
    with pytest.raises(TritonModelException, match="the name 'nv_mine' is the server's own"):
        MetricFamily("nv_mine", "Reserved", MetricFamily.GAUGE)


def test_a_familys_metrics_go_with_it() -> None:
    """Its series leave the snapshot, and using one of its Metric objects is Triton's error;
    another family object's series of the same label set stays."""
    family = MetricFamily("t_gone", "Gone", MetricFamily.GAUGE)
    kept = MetricFamily("t_gone", "Gone", MetricFamily.GAUGE)
    orphan = family.Metric(labels={"a": "1"})
    family.Metric(labels={"a": "2"}).set(2)
    kept.Metric(labels={"a": "1"}).set(1)
    del family
    gc.collect()
    reported = _reported("t_gone")
    assert reported is not None
    assert [labels for labels, _value, _at in reported["series"]] == [{"a": "1"}]
    with pytest.raises(TritonModelException, match="corresponding 'MetricFamily' has been deleted"):
        orphan.set(3)
    del kept
    gc.collect()
    assert _reported("t_gone") is None


@pytest.fixture
def in_model(tmp_path: Path) -> Iterator[None]:
    """Code that runs as model 'capped' (its version directory is set, as around execute)."""
    token = pb_utils.model_dir.set(tmp_path / "capped" / "1")
    yield
    pb_utils.model_dir.reset(token)


@pytest.mark.usefixtures("in_model")
def test_a_model_has_at_most_so_many_families_and_series() -> None:
    families = [
        MetricFamily(f"t_cap_{i}", "Capped", MetricFamily.GAUGE)
        for i in range(MAX_FAMILIES_PER_MODEL)
    ]
    with pytest.raises(TritonModelException, match="model 'capped' has 64 metric families"):
        MetricFamily("t_cap_more", "Capped", MetricFamily.GAUGE)
    metrics = [families[0].Metric(labels={"i": str(i)}) for i in range(MAX_SERIES_PER_MODEL)]
    with pytest.raises(TritonModelException, match="model 'capped' has 1024 metrics"):
        families[1].Metric(labels={"i": "more"})
    del metrics, families
    gc.collect()
    assert not [f for f in REGISTRY.snapshot() if f["name"].startswith("t_cap")]


def test_a_gauge_remembers_when_it_was_set() -> None:
    now = [1_000]
    registry = Registry(clock_ms=lambda: now[0])
    family = registry.family("g", pb_utils.MetricFamily.GAUGE, "G", "m")
    key = registry.series(family, {}, None, "m")
    now[0] = 5_000
    registry.update(family, key, lambda s: setattr(s, "value", 2.0))
    assert registry.snapshot()[0]["series"] == [[{}, 2.0, 5_000]]


# -- the gateway: the fleet's families --------------------------------------------------------


def _worker(member_id: str, families: list[dict[str, Any]]) -> Member:
    return Member(member_id, "worker", "h", 1, 1, info={INFO_KEY: families})


def test_the_fleet_adds_counters_and_histograms_up_and_keeps_the_last_gauge() -> None:
    histogram = {"bounds": [1.0, 2.5], "counts": [1, 0, 2], "sum": 9.5}
    one = _worker(
        "w1",
        [
            {"name": "c", "kind": "counter", "help": "C", "series": [[{"m": "x"}, 2, 1]]},
            {"name": "g", "kind": "gauge", "help": "G", "series": [[{}, 7, 100]]},
            {"name": "h", "kind": "histogram", "help": "H", "series": [[{"m": "x"}, histogram, 1]]},
        ],
    )
    two = _worker(
        "w2",
        [
            {"name": "c", "kind": "counter", "help": "other", "series": [[{"m": "x"}, 3.5, 9]]},
            {"name": "g", "kind": "gauge", "help": "G", "series": [[{}, 1, 50]]},
            {"name": "h", "kind": "histogram", "help": "H", "series": [[{"m": "x"}, histogram, 1]]},
            {"name": "c2", "kind": "bogus", "help": "?", "series": []},
            {"name": "nv_inference_count", "kind": "counter", "help": "x", "series": [[{}, 1, 1]]},
            {"name": "g", "kind": "counter", "help": "another kind", "series": [[{}, 5, 1]]},
        ],
    )
    gateway = Member("gw", "gateway", "h", 1, 1, info={INFO_KEY: [{"name": "x"}]})
    text = write(custom_families([two, gateway, one])).decode()
    lines = text.splitlines()
    assert lines[:3] == ["# HELP c C", "# TYPE c counter", 'c{m="x"} 5.5']
    assert "g 7" in lines
    assert lines[lines.index("# TYPE h histogram") + 1 :] == [
        'h_count{m="x"} 6',
        'h_sum{m="x"} 19',
        'h_bucket{m="x",le="1"} 2',
        'h_bucket{m="x",le="2.5"} 2',
        'h_bucket{m="x",le="+Inf"} 6',
    ]
    assert "nv_inference_count" not in text and "c2" not in text
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert parsed["h"].type == "histogram"


def test_an_instances_families_go_when_it_closes(tmp_path: Path) -> None:
    """As a Triton stub process ends on unload: even while something still holds the model
    object, its families leave the worker's metrics when its instance closes."""
    model_dir = tmp_path / "custom_metrics"
    shutil.copytree(HERE / "triton_python_repo" / "custom_metrics", model_dir)
    spec = load_model_config(model_dir, complete=complete_config)
    instance = load_instance(spec, model_dir, 1, torch.device("cpu"))
    assert isinstance(instance, TritonInstance)
    held = instance.model
    assert _reported("test_rows_total") is not None
    instance.close()
    assert _reported("test_rows_total") is None
    with pytest.raises(TritonModelException, match="'MetricFamily' has been deleted"):
        held.rows.increment(1)
