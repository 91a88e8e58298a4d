"""Prometheus exposition of the fleet's figures, with Triton's metric names and labels.

Nothing is counted in the gateway's memory: every scrape reads the per-model hashes that all
workers add to, so any gateway shows the same fleet-wide totals. The nv_* families are
written as Triton writes them (gateway/triton_exposition.py); sluice's own go through
prometheus_client.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import redis.asyncio as aioredis
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from sluice.gateway.custom_families import custom_families
from sluice.gateway.device_families import device_families
from sluice.gateway.model_table import ModelTable
from sluice.gateway.response_cache.response_cache import ResponseCache
from sluice.gateway.stream_window import StreamLoad
from sluice.gateway.triton_exposition import Family, write
from sluice.shared import keys
from sluice.shared.http_messages import HttpRequest, HttpResponse
from sluice.shared.registry import SEQUENCES
from sluice.shared.stats import (
    DEAD_LETTERED,
    FAILURE_REASONS,
    GENERATION_TOKENS,
    ITL,
    ITL_SUM,
    PROMPT_TOKENS,
    RECLAIMED,
    TTFT,
    TTFT_SUM,
    VersionStats,
    histogram,
    models_stats,
    parse_stats,
    read_stats_commands,
)

LABELS = ["model", "version"]
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

_COUNTERS = (
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        "success_count",
        1,
    ),
    (
        "nv_inference_count",
        "Number of inferences performed (does not include cached requests)",
        "inference_count",
        1,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed (does not include cached requests)",
        "execution_count",
        1,
    ),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds",
        "success_ns",
        1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds",
        "queue_ns",
        1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds",
        "compute_input_ns",
        1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds",
        "compute_infer_ns",
        1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds",
        "compute_output_ns",
        1000,
    ),
)


class _Snapshot:
    """A one-shot collector over figures already read from Redis."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self._metrics


def _failures(stats: dict[tuple[str, str], VersionStats], gateway: dict[bytes, bytes]) -> Family:
    family = Family(
        "nv_inference_request_failure",
        "counter",
        "Number of failed inference requests, all batch sizes",
    )
    totals: dict[tuple[str, str, str], int] = defaultdict(int)
    for (model, version), s in stats.items():
        for reason in FAILURE_REASONS:
            totals[(model, version, reason)] += s.get(f"failure:{reason}")
    for field, value in gateway.items():
        model, version, reason = field.decode().rsplit(":", 2)
        totals[(model, version, reason)] += int(value)
    for (model, version, reason), count in sorted(totals.items()):
        family.add({"model": model, "version": version, "reason": reason}, count)
    return family


def _batch_histogram(stats: dict[tuple[str, str], VersionStats]) -> HistogramMetricFamily:
    family = HistogramMetricFamily("sluice_batch_size", "Sizes of executed batches", labels=LABELS)
    for (model, version), s in stats.items():
        counts = {size: b.get("count", 0) for size, b in s.batches.items()}
        buckets = [
            (str(le), sum(c for size, c in counts.items() if size <= le)) for le in BATCH_BUCKETS
        ]
        buckets.append(("+Inf", sum(counts.values())))
        family.add_metric(
            [model, version], buckets, sum_value=sum(size * c for size, c in counts.items())
        )
    return family


def _latency_histograms(stats: dict[tuple[str, str], VersionStats]) -> list[Metric]:
    families: list[Metric] = []
    for name, doc, prefix, field in (
        ("sluice_queue_duration_seconds", "Time requests waited in the queue", "hq", "queue_ns"),
        ("sluice_request_duration_seconds", "Time from enqueue to answer", "hr", "success_ns"),
    ):
        family = HistogramMetricFamily(name, doc, labels=LABELS)
        for (model, version), s in sorted(stats.items()):
            family.add_metric([model, version], histogram(s, prefix), s.get(field) / 1e9)
        families.append(family)
    return families


async def _stream_gauges(redis: aioredis.Redis, table: ModelTable) -> list[Metric]:
    """Backlog per model and priority level: entries in the stream and delivered-not-acked."""
    length = GaugeMetricFamily(
        "sluice_stream_entries",
        "Entries in a request stream (queued or being served; each holds one or more requests)",
        labels=["model", "level"],
    )
    pending = GaugeMetricFamily(
        "sluice_stream_pending_entries",
        "Entries delivered to a worker and not yet answered",
        labels=["model", "level"],
    )
    for name, view in sorted(table.models.items()):
        for level in view.queue_policy.levels:
            size = held = 0
            for partition in range(view.partitions):
                stream = keys.request_stream(name, level, partition)
                try:
                    groups = await redis.xinfo_groups(stream)
                    size += await redis.xlen(stream)
                except aioredis.ResponseError:  # no such stream yet
                    continue
                held += sum(g["pending"] for g in groups)
            length.add_metric([name, str(level)], size)
            pending.add_metric([name, str(level)], held)
    return [length, pending]


def _recovery_counters(names: list[str], raws: list[dict[bytes, bytes]]) -> list[Metric]:
    reclaimed = CounterMetricFamily(
        "sluice_reclaimed_entries",
        "Stream entries taken over from workers that died",
        labels=["model"],
    )
    dead = CounterMetricFamily(
        "sluice_dead_lettered_requests",
        "Requests moved to the dead-letter stream after killing workers",
        labels=["model"],
    )
    for name, raw in zip(names, raws, strict=True):
        reclaimed.add_metric([name], int(raw.get(RECLAIMED.encode(), 0)))
        dead.add_metric([name], int(raw.get(DEAD_LETTERED.encode(), 0)))
    return [reclaimed, dead]


def _early_runs(stats: dict[tuple[str, str], VersionStats]) -> CounterMetricFamily:
    family = CounterMetricFamily(
        "sluice_early_runs",
        "Lone batches run while their delay ran out: answered by the run, or dropped because "
        "the batch formed otherwise",
        labels=[*LABELS, "outcome"],
    )
    for (model, version), s in sorted(stats.items()):
        for outcome in ("answered", "dropped"):
            family.add_metric([model, version, outcome], s.get(f"early_{outcome}"))
    return family


#: the help of the families a cache hit counts in, or does not, once a response cache runs.
_CACHED_HELP = {
    "nv_inference_request_duration_us": " (includes cached requests)",
    "nv_inference_queue_duration_us": " (includes cached requests)",
    "nv_inference_compute_input_duration_us": " (does not include cached requests)",
    "nv_inference_compute_infer_duration_us": " (does not include cached requests)",
    "nv_inference_compute_output_duration_us": " (does not include cached requests)",
}

_CACHE_COUNTERS = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", "cache_hit_count", 1),
    (
        "nv_cache_hit_duration_per_model",
        "Total cache hit duration per model, in microseconds",
        "cache_hit_ns",
        1000,
    ),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model", "cache_miss_count", 1),
    (
        "nv_cache_miss_duration_per_model",
        "Total cache miss (insert+lookup) duration per model, in microseconds",
        "cache_miss_ns",
        1000,
    ),
)


def _counters(stats: dict[tuple[str, str], VersionStats], cached: bool) -> list[Family]:
    """Triton's per-model counters; `cached`: a response cache runs, which Triton's help
    texts then say."""
    families = []
    for metric, doc, field, divisor in _COUNTERS:
        help_text = doc + _CACHED_HELP.get(metric, "") if cached else doc
        family = Family(metric, "counter", help_text)
        for (model, version), s in sorted(stats.items()):
            family.add({"model": model, "version": version}, s.get(field) // divisor)
        families.append(family)
    return families


def _cache_counters(stats: dict[tuple[str, str], VersionStats], table: ModelTable) -> list[Family]:
    """The cache's per-model counters, for the models that enable it, as Triton shows them."""
    families = []
    for metric, doc, field, divisor in _CACHE_COUNTERS:
        family = Family(metric, "counter", doc)
        for (model, version), s in sorted(stats.items()):
            view = table.models.get(model)
            if view is not None and view.config is not None and view.config.response_cache:
                family.add({"model": model, "version": version}, s.get(field) // divisor)
        families.append(family)
    return families


def _pending(stats: dict[tuple[str, str], VersionStats], table: ModelTable) -> Family:
    """Every version with statistics shows, at 0 when idle, as Triton's series do."""
    family = Family(
        "nv_inference_pending_request_count",
        "gauge",
        "Instantaneous number of pending requests awaiting execution per-model.",
    )
    inflight: dict[tuple[str, str], int] = dict.fromkeys(stats, 0)
    for member in table.members:
        for key, count in member.info.get("inflight", {}).items():
            model, _, version = key.rpartition(":")
            inflight[(model, version)] = inflight.get((model, version), 0) + count
    for (model, version), count in sorted(inflight.items()):
        family.add({"model": model, "version": version}, count)
    return family


def _generation_metrics(
    stats: dict[tuple[str, str], VersionStats], table: ModelTable
) -> list[Metric]:
    """Generative models' figures, named as vLLM names them (sluice_ for vllm:): time to first
    token and inter-token latency, prompt and generated tokens, and the sequences running and
    waiting on the fleet's workers (from their heartbeats)."""
    generating = {k: s for k, s in sorted(stats.items()) if s.get(GENERATION_TOKENS)}
    families: list[Metric] = []
    for name, doc, prefix, field in (
        ("sluice_time_to_first_token_seconds", "Time to the first token", TTFT, TTFT_SUM),
        ("sluice_inter_token_latency_seconds", "Time between two tokens", ITL, ITL_SUM),
    ):
        histogram_family = HistogramMetricFamily(name, doc, labels=LABELS)
        for (model, version), s in generating.items():
            histogram_family.add_metric([model, version], histogram(s, prefix), s.get(field) / 1e9)
        families.append(histogram_family)
    for name, doc, field in (
        ("sluice_prompt_tokens", "Prompt tokens read", PROMPT_TOKENS),
        ("sluice_generation_tokens", "Tokens generated", GENERATION_TOKENS),
    ):
        counter = CounterMetricFamily(name, doc, labels=LABELS)
        for (model, version), s in generating.items():
            counter.add_metric([model, version], s.get(field))
        families.append(counter)
    sequences: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for member in table.members:
        for model, (running, waiting) in member.info.get(SEQUENCES, {}).items():
            sequences[model][0] += running
            sequences[model][1] += waiting
    for index, (name, doc) in enumerate(
        (
            ("sluice_num_requests_running", "Sequences generating, or in a sequence slot"),
            ("sluice_num_requests_waiting", "Sequences read by workers, waiting for a slot"),
        )
    ):
        gauge = GaugeMetricFamily(name, doc, labels=["model"])
        for model, counts in sorted(sequences.items()):
            gauge.add_metric([model], counts[index])
        families.append(gauge)
    return families


async def render(
    redis: aioredis.Redis, table: ModelTable, cache: ResponseCache | None = None
) -> bytes:
    """The fleet's figures; `cache`, this gateway's response cache, first writes its own."""
    if cache is not None:
        await cache.stats.flush()
    names = sorted(table.models)
    models = [(name, table.models[name].partitions) for name in names]
    async with redis.pipeline(transaction=False) as pipe:
        for command in read_stats_commands(models):
            pipe.execute_command(*command)
        pipe.hgetall(keys.GATEWAY_STATS)
        *replies, gateway = await pipe.execute()
    raws = models_stats(replies, models)
    # every ready version shows from the start, at 0, as Triton registers a version's series
    # when it loads it
    stats: dict[tuple[str, str], VersionStats] = {
        (name, str(version)): VersionStats()
        for name, view in table.models.items()
        for version in view.ready_versions
    }
    for name, raw in zip(names, raws, strict=True):
        for version, s in parse_stats(raw).items():
            stats[(name, str(version))] = s
    nv = [*_counters(stats, cache is not None), _failures(stats, gateway)]
    if cache is not None:
        nv += _cache_counters(stats, table)
    nv += [_pending(stats, table), *(cache.families() if cache is not None else ())]
    metrics: list[Metric] = [_batch_histogram(stats), *_latency_histograms(stats)]
    metrics += await _stream_gauges(redis, table)
    metrics += [*_recovery_counters(names, raws), _early_runs(stats)]
    metrics += _generation_metrics(stats, table)
    registry = CollectorRegistry()
    registry.register(_Snapshot(metrics))
    custom = custom_families(table.members)
    return write([*nv, *device_families(table.members), *custom]) + generate_latest(registry)


def stream_gauges(streams: StreamLoad) -> bytes:
    """This gateway's own gRPC streams (not the fleet's: each gateway's port shows its own)."""
    families = []
    for name, doc, now, most in (
        (
            "sluice_grpc_stream_requests_in_flight",
            "Requests of this gateway's gRPC streams read and not yet answered to the client",
            streams.in_flight,
            streams.in_flight_max,
        ),
        (
            "sluice_grpc_stream_queued_bytes",
            "Bytes of responses this gateway's gRPC streams hold for their clients",
            streams.queued_bytes,
            streams.queued_bytes_max,
        ),
    ):
        families.append(Family(name, "gauge", doc, [({}, now)]))
        families.append(
            Family(name + "_max", "gauge", doc + ", the most since start", [({}, most)])
        )
    return write(families)


class MetricsApp:
    """Handler for the metrics port: `/metrics` only."""

    def __init__(
        self,
        redis: aioredis.Redis,
        table: ModelTable,
        streams: StreamLoad,
        cache: ResponseCache | None = None,
    ) -> None:
        self.redis = redis
        self.table = table
        self.streams = streams
        self.cache = cache

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.path != "/metrics":
            return HttpResponse(404, b"not found\n", [(b"content-type", b"text/plain")])
        body = await render(self.redis, self.table, self.cache) + stream_gauges(self.streams)
        return HttpResponse(200, body, [(b"content-type", CONTENT_TYPE_LATEST.encode())])
