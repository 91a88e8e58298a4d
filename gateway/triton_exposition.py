"""Prometheus text for the nv_* families (and models' own), written exactly as Triton writes it.

prometheus_client cannot: it appends `_total` to every counter sample and prints large values
in exponent form (`8.589934592e+10`), which perf_analyzer's `--collect-metrics` regex
(`(\\d+\\.?\\d*)`) reads as 8.59. Here counters keep their bare names, labels come sorted by
name (as Triton's prometheus-cpp prints them), integers stay integral and every other value
is a plain decimal. A histogram's series are `_count`, `_sum`, then cumulative `_bucket`s with
`le` after the other labels, ending at `+Inf`, as prometheus-cpp writes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Literal

Value = int | float


@dataclass(frozen=True, slots=True)
class Histogram:
    """One histogram series: `counts` per bucket of `bounds` (ascending), then +Inf's."""

    labels: Mapping[str, str]
    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float


@dataclass(slots=True)
class Family:
    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    samples: list[tuple[Mapping[str, str], Value]] = field(default_factory=list)
    histograms: list[Histogram] = field(default_factory=list)

    def add(self, labels: Mapping[str, str], value: Value) -> None:
        self.samples.append((labels, value))


def format_value(value: Value) -> str:
    """Plain decimal: `85899345920`, `0.25`, `0.0000001`; never exponent form."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer():
        return str(int(value))
    # repr is the shortest text that reads back as the same float; Decimal drops its exponent
    return format(Decimal(repr(value)), "f")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Mapping[str, str], le: str | None = None) -> str:
    pairs = [f'{name}="{_escape(labels[name])}"' for name in sorted(labels)]
    if le is not None:
        pairs.append(f'le="{le}"')
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _histogram_lines(name: str, histogram: Histogram) -> list[str]:
    labels = histogram.labels
    lines = [
        f"{name}_count{_labels(labels)} {sum(histogram.counts)}",
        f"{name}_sum{_labels(labels)} {format_value(histogram.sum)}",
    ]
    cumulative = 0
    for bound, count in zip((*histogram.bounds, math.inf), histogram.counts, strict=True):
        cumulative += count
        lines.append(f"{name}_bucket{_labels(labels, format_value(bound))} {cumulative}")
    return lines


def write(families: Iterable[Family]) -> bytes:
    lines: list[str] = []
    for family in families:
        help_text = family.help.replace("\\", "\\\\").replace("\n", "\\n")
        lines.append(f"# HELP {family.name} {help_text}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        lines.extend(
            f"{family.name}{_labels(labels)} {format_value(value)}"
            for labels, value in family.samples
        )
        for histogram in family.histograms:
            lines.extend(_histogram_lines(family.name, histogram))
    return ("\n".join(lines) + "\n").encode() if lines else b""
