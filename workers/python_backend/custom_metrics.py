"""`pb_utils.MetricFamily` and `Metric`: a Python model's own counters, gauges and histograms,
with Triton 2.51's behaviour and error texts.

As in Triton, families are the server's, keyed by name: two `MetricFamily` objects of one name
and kind are one family (the first description stays; another kind is an error), and two
`Metric`s of one family and label set are one series, kept while any of them is. A family
object's metrics go when it goes (Triton keeps a family's `Metric`s alive as long as the
family object); after that, using one of them is an error. One worker process keeps the
values of all its models (REGISTRY); its heartbeat carries `snapshot()` to the gateways,
which add the fleet's up (shared/custom_metrics.py). Each model may create at most
MAX_FAMILIES_PER_MODEL families and MAX_SERIES_PER_MODEL label sets.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
import re
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from sluice.shared.custom_metrics import (
    MAX_FAMILIES_PER_MODEL,
    MAX_SERIES_PER_MODEL,
    MAX_TEXT,
    RESERVED_PREFIXES,
    Kind,
)
from sluice.workers.python_backend.context import Instance, current_model, instance
from sluice.workers.python_backend.errors import TritonModelException

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_DELETED_FAMILY = (
    "Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The "
    "'MetricFamily' object should be deleted AFTER its corresponding 'Metric' objects have "
    "been deleted."
)
LabelKey = tuple[tuple[str, str], ...]


class MetricKind(enum.IntEnum):
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


_KIND_NAMES: dict[MetricKind, Kind] = {
    MetricKind.COUNTER: "counter",
    MetricKind.GAUGE: "gauge",
    MetricKind.HISTOGRAM: "histogram",
}


@dataclass(slots=True)
class _Series:
    labels: dict[str, str]
    model: str
    #: a histogram's upper bounds (None: a counter or gauge).
    bounds: tuple[float, ...] | None
    value: float = 0.0
    #: a histogram's observations per bucket, the last one +Inf's.
    counts: list[int] = field(default_factory=list)
    at_ms: int = 0
    #: the Metric objects using it.
    refs: int = 0


@dataclass(slots=True)
class _Family:
    name: str
    kind: MetricKind
    help: str
    model: str
    series: dict[LabelKey, _Series] = field(default_factory=dict)
    #: the MetricFamily objects using it.
    objects: int = 0


class Registry:
    """A worker's custom metrics (thread-safe: models run on threads of their own)."""

    def __init__(self, clock_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000) -> None:
        self._clock_ms = clock_ms
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}

    def family(self, name: str, kind: MetricKind, description: str, model: str) -> _Family:
        with self._lock:
            family = self._families.get(name)
            if family is None:
                owned = sum(f.model == model for f in self._families.values())
                if owned >= MAX_FAMILIES_PER_MODEL:
                    raise TritonModelException(
                        f"Error when creating MetricFamily: model '{model}' has "
                        f"{MAX_FAMILIES_PER_MODEL} metric families, the most a model may create"
                    )
                family = self._families[name] = _Family(name, kind, description, model)
            elif family.kind != kind:
                raise TritonModelException(
                    "Error when creating MetricFamily: Family name already exists with "
                    "different type"
                )
            family.objects += 1
            return family

    def drop_family(self, family: _Family, keys: list[LabelKey]) -> None:
        """A MetricFamily object went: its metrics, then the family once nothing uses it."""
        with self._lock:
            for key in keys:
                self._release(family, key)
            family.objects -= 1
            if not family.objects and not family.series:
                self._families.pop(family.name, None)

    def series(
        self,
        family: _Family,
        labels: dict[str, str],
        bounds: tuple[float, ...] | None,
        model: str,
    ) -> LabelKey:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = family.series.get(key)
            if series is None:
                owned = sum(
                    s.model == model for f in self._families.values() for s in f.series.values()
                )
                if owned >= MAX_SERIES_PER_MODEL:
                    raise TritonModelException(
                        f"Error when creating Metric: model '{model}' has "
                        f"{MAX_SERIES_PER_MODEL} metrics, the most a model may create"
                    )
                counts = [0] * (len(bounds) + 1) if bounds is not None else []
                series = _Series(dict(labels), model, bounds, counts=counts)
                family.series[key] = series
            series.refs += 1
            return key

    def _release(self, family: _Family, key: LabelKey) -> None:
        series = family.series.get(key)
        if series is not None:
            series.refs -= 1
            if not series.refs:
                del family.series[key]

    def update(self, family: _Family, key: LabelKey, change: Callable[[_Series], Any]) -> Any:
        with self._lock:
            series = family.series[key]
            result = change(series)
            series.at_ms = self._clock_ms()
            return result

    def read(self, family: _Family, key: LabelKey) -> float:
        with self._lock:
            return family.series[key].value

    def snapshot(self) -> list[dict[str, Any]]:
        """Every family with its series, in the heartbeat's form (shared/custom_metrics.py)."""
        with self._lock:
            return [
                {
                    "name": family.name,
                    "kind": _KIND_NAMES[family.kind],
                    "help": family.help,
                    "series": [_sample(s) for s in family.series.values()],
                }
                for family in self._families.values()
                if family.series
            ]


def _sample(series: _Series) -> list[Any]:
    if series.bounds is None:
        return [series.labels, series.value, series.at_ms]
    histogram = {"bounds": list(series.bounds), "counts": list(series.counts), "sum": series.value}
    return [series.labels, histogram, series.at_ms]


#: this worker process's custom metrics.
REGISTRY = Registry()


class _Liveness:
    """Shared by a family object and its metrics: whether the family object is still there."""

    __slots__ = ("alive",)

    def __init__(self) -> None:
        self.alive = True


class MetricFamily:
    """Triton's `pb_utils.MetricFamily(name, description, kind)`."""

    COUNTER = MetricKind.COUNTER
    GAUGE = MetricKind.GAUGE
    HISTOGRAM = MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: MetricKind) -> None:
        if not isinstance(name, str) or not isinstance(description, str):
            raise TypeError("MetricFamily(): name and description must be strings")
        if not isinstance(kind, MetricKind):
            raise TypeError("MetricFamily(): kind must be MetricFamily.COUNTER, GAUGE or HISTOGRAM")
        if len(name) > MAX_TEXT or not _METRIC_NAME.match(name):
            raise TritonModelException("Error when creating MetricFamily: Invalid metric name")
        if name.startswith(RESERVED_PREFIXES):
            raise TritonModelException(
                f"Error when creating MetricFamily: the name '{name}' is the server's own "
                f"(prefixes {', '.join(RESERVED_PREFIXES)} are reserved)"
            )
        self._state = REGISTRY.family(name, kind, description, current_model())
        self._keys: list[LabelKey] = []
        self._liveness = _Liveness()  # last: a family whose constructor raised has none
        owner = instance.get()
        if owner is not None:
            with _owned_lock:
                _owned.setdefault(owner, weakref.WeakSet()).add(self)

    def Metric(
        self, labels: dict[str, str] | None = None, buckets: list[float] | None = None
    ) -> Metric:
        """A series of this family; `buckets` (a histogram's, and only its) are its upper
        bounds, ascending."""
        if labels is not None and not isinstance(labels, dict):
            raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
        kind = self._state.kind
        bounds = None
        if buckets is not None:
            if not isinstance(buckets, list):
                raise TritonModelException("Failed to create metric. Buckets must be a list.")
            if kind != MetricKind.HISTOGRAM:
                raise TritonModelException("Failed to create metric. Unexpected buckets found.")
            bounds = tuple(float(b) for b in buckets)
            if any(b >= c for b, c in itertools.pairwise(bounds)):
                raise TritonModelException(
                    "Error when creating Metric: Bucket Boundaries must be strictly sorted"
                )
        elif kind == MetricKind.HISTOGRAM:
            raise TritonModelException("Failed to create metric. Missing required buckets.")
        checked = _checked_labels(labels or {})
        key = REGISTRY.series(self._state, checked, bounds, current_model())
        self._keys.append(key)
        return Metric(self._state, key, self._liveness)

    def __del__(self) -> None:
        self._drop()

    def _drop(self) -> None:
        liveness = getattr(self, "_liveness", None)
        if liveness is None or not liveness.alive:
            return  # never made (its constructor raised), or dropped already
        liveness.alive = False
        REGISTRY.drop_family(self._state, self._keys)


#: the families each instance created.
_owned: weakref.WeakKeyDictionary[Instance, weakref.WeakSet[MetricFamily]] = (
    weakref.WeakKeyDictionary()
)
_owned_lock = threading.Lock()


def release(owner: Instance) -> None:
    """An instance goes (an unload, a failed initialize): the families it created go with
    it, even while its model object is still referenced, as a Triton stub process ends."""
    with _owned_lock:
        families = list(_owned.pop(owner, ()))
    for family in families:
        family._drop()


def _checked_labels(labels: dict[Any, Any]) -> dict[str, str]:
    for name, value in labels.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TritonModelException(
                "Error when creating Metric: label names and values must be strings"
            )
        if len(name) > MAX_TEXT or not _LABEL_NAME.match(name) or name.startswith("__"):
            raise TritonModelException(f"Error when creating Metric: Invalid label name '{name}'")
        if len(value) > MAX_TEXT:
            raise TritonModelException(
                f"Error when creating Metric: label '{name}' is longer than {MAX_TEXT} characters"
            )
    return labels


class Metric:
    """One series of a family: made by `MetricFamily.Metric(labels, buckets)`."""

    def __init__(self, family: _Family, key: LabelKey, liveness: _Liveness) -> None:
        self._family = family
        self._key = key
        self._liveness = liveness

    def _kind(self) -> MetricKind:
        if not self._liveness.alive:
            raise TritonModelException(_DELETED_FAMILY)
        return self._family.kind

    def increment(self, value: float) -> None:
        kind = self._kind()
        if kind == MetricKind.HISTOGRAM:
            _unsupported("increment", "HISTOGRAM", "Increment")
        if kind == MetricKind.COUNTER and value < 0:
            raise TritonModelException(
                "Failed to increment metric value: TRITONSERVER_METRIC_KIND_COUNTER can only "
                "be incremented monotonically by non-negative values."
            )
        REGISTRY.update(self._family, self._key, lambda s: _add(s, float(value)))

    def set(self, value: float) -> None:
        kind = self._kind()
        if kind != MetricKind.GAUGE:
            _unsupported("set", kind.name, "Set")
        REGISTRY.update(self._family, self._key, lambda s: _assign(s, float(value)))

    def observe(self, value: float) -> None:
        kind = self._kind()
        if kind != MetricKind.HISTOGRAM:
            _unsupported("observe", kind.name, "Observe")
        REGISTRY.update(self._family, self._key, lambda s: _observe(s, float(value)))

    def value(self) -> float:
        """This worker's value (each worker keeps its own; /metrics adds the fleet's up)."""
        if self._kind() == MetricKind.HISTOGRAM:
            _unsupported("get", "HISTOGRAM", "Value")
        return REGISTRY.read(self._family, self._key)


def _unsupported(verb: str, kind: str, operation: str) -> NoReturn:
    raise TritonModelException(
        f"Failed to {verb} metric value: TRITONSERVER_METRIC_KIND_{kind} does not support "
        f"{operation}"
    )


def _add(series: _Series, value: float) -> None:
    series.value += value


def _assign(series: _Series, value: float) -> None:
    series.value = value


def _observe(series: _Series, value: float) -> None:
    assert series.bounds is not None
    # Prometheus buckets are upper-inclusive (`le`); NaN counts only in +Inf and the sum
    at = len(series.bounds) if math.isnan(value) else bisect.bisect_left(series.bounds, value)
    series.counts[at] += 1
    series.value += value
