"""Prometheus text for the nv_* families, written exactly as Triton writes it.

prometheus_client cannot: it appends `_total` to every counter sample and prints large values
in exponent form (`8.589934592e+10`), which perf_analyzer's `--collect-metrics` regex
(`(\\d+\\.?\\d*)`) reads as 8.59. Here counters keep their bare names, labels come sorted by
name (as Triton's prometheus-cpp prints them), integers stay integral and every other value
is a plain decimal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Literal

Value = int | float


@dataclass(slots=True)
class Family:
    name: str
    kind: Literal["counter", "gauge"]
    help: str
    samples: list[tuple[Mapping[str, str], Value]] = field(default_factory=list)

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


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    pairs = ",".join(f'{name}="{_escape(labels[name])}"' for name in sorted(labels))
    return "{" + pairs + "}"


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
    return ("\n".join(lines) + "\n").encode() if lines else b""
