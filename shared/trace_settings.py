"""Triton's trace extension: the settings, `--trace-config`, and an update checked as
tritonserver 2.51 checks it (its statuses and texts, side by side).

Settings are layered: the command line's, under the fleet's global ones, under a model's own
(`null` drops a model's own value, which then follows the global one again). An update is all
or nothing: every key is parsed, then the whole checked, as Triton does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

LEVELS = ("TIMESTAMPS", "TENSORS")
MODES = ("triton", "opentelemetry")
UINT32 = 2**32
#: the keys an update may carry, as /v2/trace/setting names them.
KEYS = ("trace_level", "trace_rate", "trace_count", "log_frequency")


class TraceSettingsError(Exception):
    """An update or a --trace-config Triton refuses; `status` is its HTTP status."""

    def __init__(self, status: Literal[400, 500, 501], message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class TraceSettings:
    #: the levels traced (empty: OFF).
    level: frozenset[str] = frozenset()
    rate: int = 1000
    #: traces left to collect (-1: no limit).
    count: int = -1
    log_frequency: int = 0
    file: str = ""
    mode: str = "triton"

    @property
    def on(self) -> bool:
        return bool(self.level) and self.count != 0 and self.rate > 0

    def to_json(self) -> dict[str, Any]:
        """As /v2/trace/setting answers: every value a string, the level a list."""
        return {
            "trace_level": sorted(self.level) or ["OFF"],
            "trace_rate": str(self.rate),
            "trace_count": str(self.count),
            "log_frequency": str(self.log_frequency),
            "trace_file": self.file,
            "trace_mode": self.mode,
        }

    def with_values(self, values: Mapping[str, Any]) -> TraceSettings:
        """These settings with parsed `values` (field name -> value) over them."""
        fields = ("level", "rate", "count", "log_frequency")
        known = {k: v for k, v in values.items() if k in fields}
        if "level" in known:
            known["level"] = frozenset(known["level"])
        return dataclasses.replace(self, **known)

    def checked(self) -> TraceSettings:
        if self.level and self.mode == "triton" and not self.file:
            raise TraceSettingsError(
                400, "Attempting to set invalid trace setting :trace file name is not given"
            )
        return self


def parse_update(body: Mapping[str, Any]) -> dict[str, Any]:
    """The field values an update sets (`null`: drop the value set before, None here, so
    that a model's follows the global one and the global one the command line's). Raises
    TraceSettingsError as Triton answers."""
    if "trace_file" in body:
        raise TraceSettingsError(
            501, "trace file location can not be updated through network protocol"
        )
    values: dict[str, Any] = {}
    for key in KEYS:
        if key not in body:
            continue
        raw = body[key]
        name = key.removeprefix("trace_")
        if raw is None:
            values[name] = None
        elif key == "trace_level":
            levels = _levels(raw)
            if levels is not None:
                values[name] = levels
        else:
            values[name] = _number(key, raw)
    return values


def _levels(raw: Any) -> list[str] | None:
    if not isinstance(raw, list):
        raise TraceSettingsError(500, "attempt to access JSON non-array as array")
    if not all(isinstance(level, str) for level in raw):
        raise TraceSettingsError(500, "attempt to access JSON non-string as string")
    if "OFF" in raw:
        if len(raw) > 1:
            raise TraceSettingsError(400, "Expect only one trace level 'OFF' is specified")
        return []
    known = [level for level in raw if level in LEVELS]
    return known if known else None  # only unknown levels: no change, as tritonserver


def _number(key: str, raw: Any) -> int:
    if not isinstance(raw, str):
        raise TraceSettingsError(500, "attempt to access JSON non-string as string")
    try:
        value = int(raw)
    except ValueError:
        raise TraceSettingsError(400, f"Unable to parse '{key}', got: {raw}") from None
    if key == "trace_count":
        if value < -1:
            raise TraceSettingsError(
                400, f"Unable to parse 'trace_count'. Expecting value >= -1, got:{raw}"
            )
        return value
    return value % UINT32  # tritonserver reads these as uint32: -1 is 4294967295


def parse_trace_config(entries: Iterable[str]) -> TraceSettings:
    """`--trace-config [<mode>,]<setting>=<value>`, repeatable, as tritonserver takes it."""
    settings = TraceSettings()
    for entry in entries:
        mode, _, pair = entry.rpartition(",")
        name, equals, value = pair.partition("=")
        if not equals:
            raise ValueError(f"--trace-config {entry}: expected [<mode>,]<setting>=<value>")
        if mode and mode not in MODES:
            raise ValueError(f"--trace-config {entry}: unknown mode '{mode}'")
        if name == "mode":
            if value not in MODES:
                raise ValueError(f"--trace-config {entry}: mode must be triton or opentelemetry")
            settings = dataclasses.replace(settings, mode=value)
        elif name == "file":
            settings = dataclasses.replace(settings, file=value)
        elif name == "level":
            level = frozenset() if value == "OFF" else settings.level | {value}
            if value != "OFF" and value not in LEVELS:
                raise ValueError(f"--trace-config {entry}: level must be OFF, TIMESTAMPS, TENSORS")
            settings = dataclasses.replace(settings, level=level)
        elif name in ("rate", "count", "log-frequency"):
            key = {"rate": "trace_rate", "count": "trace_count"}.get(name, "log_frequency")
            try:
                number = _number(key, value)
            except TraceSettingsError as exc:
                raise ValueError(f"--trace-config {entry}: {exc}") from None
            settings = settings.with_values({name.replace("-", "_"): number})
        else:
            raise ValueError(f"--trace-config {entry}: unknown setting '{name}'")
    if settings.mode == "opentelemetry":
        raise ValueError("--trace-config mode=opentelemetry: not served yet; use mode=triton")
    try:
        return settings.checked()
    except TraceSettingsError as exc:
        raise ValueError(f"--trace-config: {exc}") from None
