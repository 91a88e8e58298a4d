"""Python models' own metric families (pb_utils.MetricFamily), read from the workers'
heartbeats and added up across the fleet, as Triton's one process holds one value per series.

A counter's and a histogram's series are summed over the workers that have them (a histogram
only where its buckets match the first worker's); a gauge's is the one set last. A family is
the first worker's kind and description (by worker id); another kind under its name elsewhere
is left out. Series keep the model's own labels: Triton's carry no worker label either. A
worker that is gone takes its part of the sums with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from sluice.gateway.triton_exposition import Family, Histogram, Value
from sluice.shared import custom_metrics as cm
from sluice.shared.registry import Member

LabelKey = tuple[tuple[str, str], ...]


@dataclass(slots=True)
class _Series:
    labels: dict[str, str]
    value: Value = 0
    at_ms: int = -1
    bounds: tuple[float, ...] | None = None
    counts: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Family:
    kind: cm.Kind
    help: str
    series: dict[LabelKey, _Series] = field(default_factory=dict)


def custom_families(members: Iterable[Member]) -> list[Family]:
    """The fleet's custom families, in the order workers first report them."""
    families: dict[str, _Family] = {}
    for member in sorted(members, key=lambda m: m.id):
        reported = member.info.get(cm.INFO_KEY) if member.kind == "worker" else None
        for name, kind, help_text, series in _families(reported):
            family = families.setdefault(name, _Family(kind, help_text))
            if family.kind != kind:
                continue
            for labels, value, at_ms in series:
                _merge(family, labels, value, at_ms)
    return [_exposed(name, family) for name, family in families.items() if family.series]


def _families(reported: Any) -> Iterator[tuple[str, cm.Kind, str, list[Any]]]:
    """The well-formed families of a heartbeat; anything else is skipped."""
    for item in reported if isinstance(reported, list) else ():
        if not isinstance(item, dict):
            continue
        name, kind, help_text, series = (item.get(k) for k in ("name", "kind", "help", "series"))
        if (
            isinstance(name, str)
            and not name.startswith(cm.RESERVED_PREFIXES)
            and kind in cm.KINDS
            and isinstance(help_text, str)
            and isinstance(series, list)
        ):
            yield name, kind, help_text, series


def _merge(family: _Family, labels: Any, value: Any, raw_at_ms: Any) -> None:
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        return
    at_ms = raw_at_ms if isinstance(raw_at_ms, int) else 0
    key = tuple(sorted(labels.items()))
    if family.kind == "histogram":
        _merge_histogram(family, key, labels, value)
        return
    if not _is_number(value):
        return
    series = family.series.get(key)
    if series is None:
        family.series[key] = _Series(labels, value, at_ms)
    elif family.kind == "counter":
        series.value += value
    elif at_ms > series.at_ms:
        series.value, series.at_ms = value, at_ms


def _merge_histogram(family: _Family, key: LabelKey, labels: dict[str, str], value: Any) -> None:
    if not isinstance(value, dict):
        return
    bounds, counts, total = value.get("bounds"), value.get("counts"), value.get("sum")
    if not (
        _is_number(total)
        and isinstance(bounds, list)
        and isinstance(counts, list)
        and len(counts) == len(bounds) + 1
        and all(_is_number(b) for b in bounds)
        and all(isinstance(c, int) and c >= 0 for c in counts)
    ):
        return
    series = family.series.get(key)
    if series is None:
        family.series[key] = _Series(labels, total, 0, tuple(bounds), list(counts))
    elif series.bounds == tuple(bounds):
        series.value += total
        series.counts = [a + b for a, b in zip(series.counts, counts, strict=True)]


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _exposed(name: str, family: _Family) -> Family:
    exposed = Family(name, family.kind, family.help)
    for series in family.series.values():
        labels: Mapping[str, str] = series.labels
        if series.bounds is None:
            exposed.add(labels, series.value)
        else:
            exposed.histograms.append(
                Histogram(labels, series.bounds, tuple(series.counts), series.value)
            )
    return exposed
