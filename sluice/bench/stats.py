"""Measurement windows as perf_analyzer keeps them: summaries, percentiles and stability.

Pure functions over what the load loop recorded, so the decision "measure again or report"
can be tested without running load.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.bench.server_stats import ServerSplit, ServerTotals, split

#: stable = this many consecutive windows agree (perf_analyzer's rule)
STABLE_WINDOWS = 3


@dataclass(frozen=True, slots=True)
class WindowSample:
    """What one window recorded, raw."""

    duration_s: float
    cpu_s: float
    #: latencies of the successful requests that completed in the window
    latencies_ns: list[int]
    #: error description -> count
    errors: dict[str, int] = field(default_factory=dict)
    #: the server's counters over the window (None: the server keeps no statistics)
    server: ServerTotals | None = None


@dataclass(frozen=True, slots=True)
class Latency:
    avg_us: float
    p50_us: float
    p90_us: float
    p95_us: float
    p99_us: float


@dataclass(frozen=True, slots=True)
class Measurement:
    """One or more windows, summarised."""

    windows: int
    duration_s: float
    requests: int
    errors: int
    error_kinds: dict[str, int]
    #: inferences per second: successful requests x batch size / duration
    throughput: float
    latency: Latency | None
    #: client CPU time / wall time (1.0 = one core busy)
    client_cpu: float
    server: ServerSplit | None


def percentile(sorted_values: Sequence[int], q: float) -> float:
    """Nearest-rank percentile of ascending values: the smallest with q% at or below it."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


def summarize(latencies_ns: Sequence[int]) -> Latency | None:
    if not latencies_ns:
        return None
    ordered = sorted(latencies_ns)
    return Latency(
        avg_us=sum(ordered) / len(ordered) / 1e3,
        p50_us=percentile(ordered, 50) / 1e3,
        p90_us=percentile(ordered, 90) / 1e3,
        p95_us=percentile(ordered, 95) / 1e3,
        p99_us=percentile(ordered, 99) / 1e3,
    )


def measure(windows: Sequence[WindowSample], batch_size: int) -> Measurement:
    """Merge windows: latency percentiles over all their samples, rates over their total time."""
    duration_s = sum(w.duration_s for w in windows)
    latencies_ns = [x for w in windows for x in w.latencies_ns]
    errors: Counter[str] = Counter()
    for w in windows:
        errors.update(w.errors)
    servers = [w.server for w in windows]
    server = None
    if windows and all(s is not None for s in servers):
        server = split(sum((s for s in servers if s is not None), ServerTotals()))
    return Measurement(
        windows=len(windows),
        duration_s=duration_s,
        requests=len(latencies_ns),
        errors=sum(errors.values()),
        error_kinds=dict(errors),
        throughput=len(latencies_ns) * batch_size / duration_s if duration_s else 0.0,
        latency=summarize(latencies_ns),
        client_cpu=sum(w.cpu_s for w in windows) / duration_s if duration_s else 0.0,
        server=server,
    )


def within(values: Sequence[float], percent: float) -> bool:
    """Every value within ±percent of their mean."""
    mean = sum(values) / len(values)
    if mean == 0:
        return all(v == 0 for v in values)
    return all(abs(v - mean) <= mean * percent / 100 for v in values)


def is_stable(measurements: Sequence[Measurement], percent: float) -> bool:
    """The last windows agree on throughput and p95 latency within ±percent."""
    if len(measurements) < STABLE_WINDOWS:
        return False
    last = measurements[-STABLE_WINDOWS:]
    p95_us = [m.latency.p95_us if m.latency else 0.0 for m in last]
    return within([m.throughput for m in last], percent) and within(p95_us, percent)
