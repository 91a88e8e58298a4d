"""The monitoring files in deploy/ load, and query the metrics sluice serves."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

DEPLOY = Path(__file__).parent.parent / "deploy"
#: every per-model metric family the gateways export (gateway/metrics.py), as Prometheus
#: stores them (Triton's bare counter names, sluice's own with _total)
SERVED = {
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_pending_request_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
    "sluice_batch_size_bucket",
    "sluice_queue_duration_seconds_bucket",
    "sluice_request_duration_seconds_bucket",
    "sluice_stream_entries",
    "sluice_stream_pending_entries",
    "sluice_reclaimed_entries_total",
    "sluice_dead_lettered_requests_total",
    "sluice_early_runs_total",
    "nv_cache_num_hits_per_model",
    "nv_cache_num_misses_per_model",
    "nv_cache_hit_duration_per_model",
    "nv_cache_miss_duration_per_model",
    "sluice_num_requests_running",
    "sluice_num_requests_waiting",
    # per worker, from --price-per-hour (gateway/device_families.py)
    "sluice_worker_price_per_hour",
}


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_prometheus_config_scrapes_the_gateway_metrics_port() -> None:
    text = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    assert "scrape_configs:" in text
    assert "sluice-gateway:8002" in text
    try:
        import yaml
    except ImportError:
        return
    config = yaml.safe_load(text)
    (job,) = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["sluice-gateway:8002"]


def test_dashboard_is_valid_json_with_a_model_variable() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "sluice-dashboard.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["model"]["definition"] == ("label_values(nv_inference_request_success, model)")
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in _panels(dashboard):
        for target in panel["targets"]:
            assert '{model=~"$model"}' in target["expr"], (panel["title"], target["expr"])


def test_dashboard_queries_only_served_metrics_and_covers_them() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "sluice-dashboard.json").read_text())
    exprs = [t["expr"] for p in _panels(dashboard) for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(nv_\w+|sluice_\w+)\{", e)}
    assert used == SERVED
    for expr in exprs:  # a cheap syntax check without promtool: brackets balance
        depth = 0
        for char in expr:
            depth += {"(": 1, ")": -1}.get(char, 0)
            assert depth >= 0, expr
        assert depth == 0, expr


@pytest.mark.parametrize("quantile", ["0.5", "0.95"])
def test_dashboard_batch_quantiles(quantile: str) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "sluice-dashboard.json").read_text())
    exprs = [t["expr"] for p in _panels(dashboard) for t in p["targets"]]
    assert any(e.startswith(f"histogram_quantile({quantile}, ") for e in exprs)
