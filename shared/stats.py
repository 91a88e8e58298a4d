"""Triton's per-model statistics, kept fleet-wide in one Redis hash per model.

Workers add a batch's figures with the script call that also acks and deletes the batch's
stream entries (same hash slot), so statistics cost no extra round trip. The figures go onto
the model's statistics log as one record; a reader folds the log into the hash before
reading it (`read_stats_command`), and the worker's script folds it every `FOLD_AT`
records. So a batch's statistics are in Redis when its clients have their answers, at the
cost of one RPUSH on the answer's way rather than a score of HINCRBYs. Fields are
`<version>:<counter>`; per-batch-size figures are `<version>:b<size>:<phase>`.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
from sluice.shared import keys
from sluice.shared.lua import Lua

#: records a worker's script lets pile up on a statistics log before folding them in.
FOLD_AT = 16

#: sum a statistics log's records (`last_inference` fields: the latest), add them to the hash.
_FOLD_LUA = """
local function fold(stats, log)
  local records = redis.call('LRANGE', log, 0, -1)
  if #records == 0 then return end
  redis.call('DEL', log)
  local sums, latest = {}, {}
  for _, record in ipairs(records) do
    local increments = cmsgpack.unpack(record)
    for i = 1, #increments, 2 do
      local f, v = increments[i], increments[i + 1]
      if string.sub(f, -14) == 'last_inference' then
        if (latest[f] or -1) < v then latest[f] = v end
      else
        sums[f] = (sums[f] or 0) + v
      end
    end
  end
  for f, v in pairs(sums) do redis.call('HINCRBY', stats, f, v) end
  for f, v in pairs(latest) do
    if tonumber(redis.call('HGET', stats, f) or '0') < v then redis.call('HSET', stats, f, v) end
  end
end
"""

#: ack + delete a batch's stream entries, lower the queue-size counter of their priority level,
#: then log the batch's statistics record, if any (KEYS: stream, stats, queue sizes, log).
FINISH_BATCH = Lua(
    _FOLD_LUA
    + f"""
local n = tonumber(ARGV[2])
if n > 0 then
  redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3, 2 + n))
  redis.call('XDEL', KEYS[1], unpack(ARGV, 3, 2 + n))
end
local answered = tonumber(ARGV[4 + n])
if answered > 0 then
  local left = (tonumber(redis.call('HGET', KEYS[3], ARGV[3 + n]) or '0')) - answered
  if left < 0 then left = 0 end
  redis.call('HSET', KEYS[3], ARGV[3 + n], left)
end
local record = ARGV[5 + n]
if record and redis.call('RPUSH', KEYS[4], record) >= {FOLD_AT} then fold(KEYS[2], KEYS[4]) end
return n
"""
)

_READ_STATS = Lua(_FOLD_LUA + "fold(KEYS[1], KEYS[2])\nreturn redis.call('HGETALL', KEYS[1])\n")


#: log a record, folding the log once it holds FOLD_AT (KEYS: stats, log): for records of
#: requests that never reach a worker's batch (a gateway's cache hits).
_LOG_STATS = Lua(
    _FOLD_LUA + f"if redis.call('RPUSH', KEYS[2], ARGV[1]) >= {FOLD_AT} then "
    "fold(KEYS[1], KEYS[2]) end\nreturn 1\n"
)


def log_stats_command(model: str, record: bytes) -> tuple[Any, ...]:
    """The command that adds one statistics record to `model`'s statistics."""
    return _LOG_STATS.command([keys.model_stats(model), keys.model_stats_log(model)], [record])


def cache_hit_increments(version: int, duration_ns: int, at_ms: int) -> list[str | int]:
    """A request answered from the response cache: a success and a queue entry with no wait
    (Triton counts it so) and a cache hit, but no inference and no execution."""
    v = version
    return [
        *(f"{v}:success_count", 1, f"{v}:success_ns", duration_ns),
        *(f"{v}:queue_count", 1, f"{v}:queue_ns", 0),
        *(f"{v}:cache_hit_count", 1, f"{v}:cache_hit_ns", duration_ns),
        *(f"{v}:last_inference", at_ms),
    ]


def cache_miss_increments(version: int, duration_ns: int) -> list[str | int]:
    """A lookup that missed and the insert of its response (the request's own figures come
    from the batch that ran it)."""
    return [f"{version}:cache_miss_count", 1, f"{version}:cache_miss_ns", duration_ns]


def stats_record(increments: Sequence[str | int]) -> bytes:
    """A batch's (field, amount) pairs as one record of a statistics log."""
    return msgpack.packb(increments)


def read_stats_command(model: str, partition: int = 0) -> tuple[Any, ...]:
    """The command that folds the statistics log of `model` (of one of its partitions) into
    its hash and returns the hash."""
    stats_keys = [keys.model_stats(model, partition), keys.model_stats_log(model, partition)]
    return _READ_STATS.command(stats_keys, [])


def read_stats_commands(models: Sequence[tuple[str, int]]) -> list[tuple[Any, ...]]:
    """`read_stats_command` for each partition (shared/partitions.py) of each (model,
    partition count); `models_stats` reads their replies."""
    return [read_stats_command(model, p) for model, count in models for p in range(count)]


def stats_hash(reply: Sequence[bytes]) -> dict[bytes, bytes]:
    """The hash from `read_stats_command`'s reply (a flat field, value list)."""
    return dict(zip(reply[::2], reply[1::2], strict=True))


def models_stats(
    replies: Sequence[Sequence[bytes]], models: Sequence[tuple[str, int]]
) -> list[dict[bytes, bytes]]:
    """Each model's statistics hash from the replies to `read_stats_commands(models)`."""
    by_partition = iter(replies)
    return [merged_stats_hash([next(by_partition) for _ in range(n)]) for _, n in models]


def merged_stats_hash(replies: Sequence[Sequence[bytes]]) -> dict[bytes, bytes]:
    """One model's hash from its partitions' `read_stats_command` replies: counters sum,
    `last_inference` fields keep the latest."""
    if len(replies) == 1:
        return stats_hash(replies[0])
    merged: dict[bytes, int] = {}
    for reply in replies:
        for field_name, value in stats_hash(reply).items():
            amount = int(value)
            if field_name.endswith(b"last_inference"):
                merged[field_name] = max(merged.get(field_name, 0), amount)
            else:
                merged[field_name] = merged.get(field_name, 0) + amount
    return {field_name: str(value).encode() for field_name, value in merged.items()}


def add_increments(into: dict[str, int], increments: Sequence[str | int]) -> None:
    """Add `increments` (field, amount pairs) to `into` as a statistics log is folded into the
    hash: counters sum, `last_inference` keeps the latest."""
    for field_name, value in zip(increments[::2], increments[1::2], strict=True):
        name, amount = str(field_name), int(value)
        if name.endswith("last_inference"):
            into[name] = max(into.get(name, 0), amount)
        else:
            into[name] = into.get(name, 0) + amount


DURATIONS = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
)
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


@dataclass(slots=True)
class BatchStats:
    """What one executed batch adds to its model's statistics."""

    version: int
    batch_size: int
    last_inference_ms: int
    requests_ok: int = 0
    requests_failed: int = 0
    failure_reason: str = "BACKEND"
    #: per request of the batch answered without an error: time in queue, and from enqueue
    #: to answer (Triton samples successful requests only); per failed request, the latter.
    queue_samples_ns: list[int] = field(default_factory=list)
    request_samples_ns: list[int] = field(default_factory=list)
    failed_samples_ns: list[int] = field(default_factory=list)
    #: phase durations of the batch, counted once per successful request as Triton does
    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0
    #: when the batch's run started (wall clock): its traced requests' COMPUTE_START.
    started_ns: int = 0
    #: the batch was answered by a run made while its delay ran out; a run made early for
    #: other requests was dropped when this batch was formed.
    early_answered: bool = False
    early_dropped: bool = False
    #: rows of the batch that were a sequence batch's null requests: executed, and counted in
    #: its batch size, but no inferences of their own (as Triton counts them).
    null_rows: int = 0

    def compute_timestamps(self) -> list[int]:
        """COMPUTE_START, COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END of the run."""
        input_end = self.started_ns + self.input_ns
        output_start = input_end + self.infer_ns
        return [self.started_ns, input_end, output_start, output_start + self.output_ns]

    def settle(self, enqueued_ns: Sequence[int], failed: Sequence[bool], finished_ns: int) -> None:
        """Count the batch's requests (enqueued at `enqueued_ns`, `queue_samples_ns` already
        taken for each) as answered at `finished_ns`: one answered with an error is a failure
        with its duration alone, as Triton counts a request its backend failed."""
        durations_ns = [max(0, finished_ns - at_ns) for at_ns in enqueued_ns]
        self.requests_failed = sum(failed)
        self.requests_ok = len(failed) - self.requests_failed
        self.failed_samples_ns = [d for d, bad in zip(durations_ns, failed, strict=True) if bad]
        self.request_samples_ns = [
            d for d, bad in zip(durations_ns, failed, strict=True) if not bad
        ]
        self.queue_samples_ns = [
            q for q, bad in zip(self.queue_samples_ns, failed, strict=True) if not bad
        ]

    def increments(self) -> list[str | int]:
        v = self.version
        ok = self.requests_ok
        pairs: list[str | int] = [
            f"{v}:inference_count",
            self.batch_size - self.null_rows,
            f"{v}:execution_count",
            1,
            f"{v}:last_inference",
            self.last_inference_ms,
            f"{v}:queue_count",
            ok,
            f"{v}:queue_ns",
            sum(self.queue_samples_ns),
            f"{v}:compute_input_count",
            ok,
            f"{v}:compute_input_ns",
            self.input_ns * ok,
            f"{v}:compute_infer_count",
            ok,
            f"{v}:compute_infer_ns",
            self.infer_ns * ok,
            f"{v}:compute_output_count",
            ok,
            f"{v}:compute_output_ns",
            self.output_ns * ok,
            f"{v}:b{self.batch_size}:count",
            1,
            f"{v}:b{self.batch_size}:compute_input_ns",
            self.input_ns,
            f"{v}:b{self.batch_size}:compute_infer_ns",
            self.infer_ns,
            f"{v}:b{self.batch_size}:compute_output_ns",
            self.output_ns,
        ]
        if ok:
            pairs += [f"{v}:success_count", ok, f"{v}:success_ns", sum(self.request_samples_ns)]
        if self.early_answered:
            pairs += [f"{v}:early_answered", 1]
        if self.early_dropped:
            pairs += [f"{v}:early_dropped", 1]
        pairs += histogram_increments(f"{v}:hq", self.queue_samples_ns)
        pairs += histogram_increments(f"{v}:hr", self.request_samples_ns)
        if self.requests_failed:
            pairs += [
                f"{v}:fail_count",
                self.requests_failed,
                f"{v}:fail_ns",
                sum(self.failed_samples_ns),
                f"{v}:failure:{self.failure_reason}",
                self.requests_failed,
            ]
        return pairs


#: bucket bounds (seconds) of the queue-time and request-time histograms.
LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_BUCKET_BOUNDS_NS = [int(bound_s * 1e9) for bound_s in LATENCY_BUCKETS_S]

#: a generative model's fields (after "<version>:"): time-to-first-token and inter-token
#: latency histograms (per-bucket counts under these prefixes, sums in nanoseconds), tokens.
TTFT, TTFT_SUM = "ht", "ttft_ns"
ITL, ITL_SUM = "hi", "itl_ns"
PROMPT_TOKENS, GENERATION_TOKENS = "prompt_tokens", "generation_tokens"

#: fields kept for the whole model, not per version.
RECLAIMED = "all:reclaimed"
DEAD_LETTERED = "all:dead_lettered"


def histogram_increments(prefix: str, samples_ns: list[int]) -> list[str | int]:
    """Per-bucket (not cumulative) counts, so that many workers can add to them."""
    counts: dict[int, int] = {}
    for sample_ns in samples_ns:
        index = bisect.bisect_left(_BUCKET_BOUNDS_NS, sample_ns)
        counts[index] = counts.get(index, 0) + 1
    return [x for index, count in counts.items() for x in (f"{prefix}{index}", count)]


def histogram(stats: VersionStats, prefix: str) -> list[tuple[str, int]]:
    """Cumulative Prometheus buckets from the per-bucket counts."""
    buckets, total = [], 0
    for index, bound_s in enumerate(LATENCY_BUCKETS_S):
        total += stats.get(f"{prefix}{index}")
        buckets.append((str(bound_s), total))
    buckets.append(("+Inf", total + stats.get(f"{prefix}{len(LATENCY_BUCKETS_S)}")))
    return buckets


def failure_increments(version: int, reason: str, count: int) -> list[str | int]:
    """Counters for requests that failed before reaching the model (timeouts, cancellations)."""
    return [f"{version}:fail_count", count, f"{version}:failure:{reason}", count]


@dataclass(slots=True)
class VersionStats:
    """Cumulative statistics of one model version, parsed from the hash."""

    counters: dict[str, int] = field(default_factory=dict)
    #: batch size -> {"count", "compute_input_ns", ...}
    batches: dict[int, dict[str, int]] = field(default_factory=dict)

    def get(self, name: str) -> int:
        return self.counters.get(name, 0)


def parse_stats(raw: Mapping[bytes, bytes] | Mapping[str, str]) -> dict[int, VersionStats]:
    """Group a stats hash by version."""
    out: dict[int, VersionStats] = defaultdict(VersionStats)
    for key, value in raw.items():
        text = key.decode() if isinstance(key, bytes) else key
        version, _, rest = text.partition(":")
        if not version.isdigit():
            continue
        stats = out[int(version)]
        if rest.startswith("b") and rest[1:2].isdigit():
            size, _, phase = rest[1:].partition(":")
            stats.batches.setdefault(int(size), {})[phase] = int(value)
        else:
            stats.counters[rest] = int(value)
    return dict(out)


def triton_model_stats(name: str, version: int, stats: VersionStats) -> dict[str, Any]:
    """One entry of Triton's `model_stats` list; every count/ns field present (perf_analyzer)."""
    inference_stats = {
        d: {"count": stats.get(f"{d}_count"), "ns": stats.get(f"{d}_ns")} for d in DURATIONS
    }
    batch_stats = [
        {
            "batch_size": size,
            "compute_input": {"count": b.get("count", 0), "ns": b.get("compute_input_ns", 0)},
            "compute_infer": {"count": b.get("count", 0), "ns": b.get("compute_infer_ns", 0)},
            "compute_output": {"count": b.get("count", 0), "ns": b.get("compute_output_ns", 0)},
        }
        for size, b in sorted(stats.batches.items())
    ]
    return {
        "name": name,
        "version": str(version),
        "last_inference": stats.get("last_inference"),
        "inference_count": stats.get("inference_count"),
        "execution_count": stats.get("execution_count"),
        "inference_stats": inference_stats,
        "response_stats": {},
        "batch_stats": batch_stats,
        "memory_usage": [],
    }
