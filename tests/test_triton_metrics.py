"""/metrics in Triton's exact form: bare counter names, sorted labels, plain decimals.

Statistics reach Redis through the worker's own publisher and heartbeats through the fleet
hash, then a gateway's model table and renderer read them back, as on a scrape.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from sluice.gateway.metrics import render
from sluice.gateway.model_table import ModelTable
from sluice.gateway.triton_exposition import Family, format_value, write
from sluice.shared import keys
from sluice.shared.device_metrics import INFO_KEY
from sluice.shared.model_config import load_model_config
from sluice.shared.redis_client import async_client
from sluice.shared.registry import Member, ModelStatus, encode_model_record, now_ms
from sluice.shared.stats import BatchStats, failure_increments
from sluice.workers.answers.publisher import Publisher

from tests.streams import PLUS_ONE_MODEL, int_model_config, write_python_model

#: 80 GiB: prometheus_client would print it as 8.589934592e+10.
BIG = 85_899_345_920
GPU = "GPU-5d8c5f2a-9d3e-4f7b-8a1c-2b3c4d5e6f70"
NV_COUNTERS = (
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = async_client(redis_url)
    yield client
    await client.aclose()


async def _scrape(redis: aioredis.Redis, tmp_path: Path) -> str:
    """Three requests of model m answered in one batch, one failed, a big request duration,
    two in flight on this gateway, a worker with a GPU serving m and an idle model; then one
    scrape."""
    repo = write_python_model(tmp_path, "m", int_model_config("m"), PLUS_ONE_MODEL)
    config = load_model_config(repo / "m").config_json
    await redis.hset(keys.MODELS, "m", encode_model_record(config, [1], None))
    await redis.hset(keys.MODELS, "idle", encode_model_record(config, [1], None))
    stats = BatchStats(1, 3, now_ms(), requests_ok=3)
    stats.queue_samples_ns = [1_000_000, 2_000_000, 3_000_000]
    stats.request_samples_ns = [BIG * 1000, 0, 0]
    publisher = Publisher(redis, "m", set())
    await publisher.publish([], [], [*stats.increments(), *failure_increments(1, "BACKEND", 1)])
    await publisher.close()
    sample = {"at_ms": now_ms(), "cpu": {}, "gpus": {GPU: {"nv_gpu_memory_total_bytes": BIG}}}
    ready = {"m": ModelStatus([1]), "idle": ModelStatus([1])}
    worker = Member("w1", "worker", "h", 1, now_ms(), ready, info={INFO_KEY: sample})
    await redis.hset(keys.FLEET, "w1", worker.encode())
    table = ModelTable(redis, "gw-test", lambda: {"m:1": 2})
    await table.refresh()
    return (await render(redis, table)).decode()


async def test_nv_families_have_triton_names_types_and_labels(
    redis: aioredis.Redis, tmp_path: Path
) -> None:
    text = await _scrape(redis, tmp_path)
    lines = text.splitlines()
    for name in NV_COUNTERS:
        assert f"# TYPE {name} counter" in lines, name
    assert "# TYPE nv_inference_pending_request_count gauge" in lines
    assert (
        "# HELP nv_inference_request_success Number of successful inference requests, "
        "all batch sizes" in lines
    )
    assert 'nv_inference_request_success{model="m",version="1"} 3' in lines
    assert 'nv_inference_count{model="m",version="1"} 3' in lines
    assert 'nv_inference_exec_count{model="m",version="1"} 1' in lines
    assert 'nv_inference_queue_duration_us{model="m",version="1"} 6000' in lines
    assert f'nv_inference_request_duration_us{{model="m",version="1"}} {BIG}' in lines
    assert 'nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 1' in lines
    assert 'nv_inference_request_failure{model="m",reason="REJECTED",version="1"} 0' in lines
    assert 'nv_inference_pending_request_count{model="m",version="1"} 2' in lines
    # a loaded version that served nothing yet shows at 0, as in Triton
    for name in (*NV_COUNTERS[:1], *NV_COUNTERS[2:], "nv_inference_pending_request_count"):
        assert f'{name}{{model="idle",version="1"}} 0' in lines, name
    # Triton's names only: no suffix, no _created, no exponent anywhere in the nv_* lines
    nv_lines = [line for line in lines if line.startswith("nv_")]
    assert not [line for line in nv_lines if re.match(r"nv_\w+_(total|created)\b", line)]
    assert not [line for line in nv_lines if "e+" in line.split()[-1]]
    # sluice's own metrics keep Prometheus conventions
    assert any(line.startswith("sluice_reclaimed_entries_total{") for line in lines)


async def test_exposition_parses_as_prometheus_and_as_perf_analyzer_reads_it(
    redis: aioredis.Redis, tmp_path: Path
) -> None:
    text = await _scrape(redis, tmp_path)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in NV_COUNTERS:
        assert families[name].type == "counter", name
    success = families["nv_inference_request_success"].samples
    assert [(s.labels, s.value) for s in success] == [
        ({"model": "idle", "version": "1"}, 0.0),
        ({"model": "m", "version": "1"}, 3.0),
    ]
    durations = {
        s.labels["model"]: s.value for s in families["nv_inference_request_duration_us"].samples
    }
    assert durations == {"idle": 0, "m": BIG}
    assert families["nv_gpu_memory_total_bytes"].type == "gauge"
    # perf_analyzer --collect-metrics: ParseAndStoreMetric's regex, value read as a number
    pattern = r'\nnv_gpu_memory_total_bytes\{gpu_uuid="([^"]+)"\} (\d+\.?\d*)'
    assert re.findall(pattern, text) == [(GPU, str(BIG))]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (BIG, "85899345920"),
        (float(BIG), "85899345920"),
        (0.25, "0.25"),
        (1e-7, "0.0000001"),
        (1.5e20, "150000000000000000000"),
        (123456789.125, "123456789.125"),
        (float("inf"), "+Inf"),
    ],
)
def test_values_are_plain_decimals(value: float, text: str) -> None:
    assert format_value(value) == text


def test_label_values_are_escaped_and_read_back() -> None:
    family = Family("nv_inference_count", "counter", "Number of inferences performed")
    family.add({"version": "1", "model": 'a"b\\c\nd'}, 7)
    text = write([family]).decode()
    assert text.splitlines()[2] == 'nv_inference_count{model="a\\"b\\\\c\\nd",version="1"} 7'
    (parsed,) = text_string_to_metric_families(text)
    assert parsed.samples[0].labels == {"model": 'a"b\\c\nd', "version": "1"}
