"""Triton's trace extension: the settings, `--trace-config`, and an update checked as
tritonserver 2.51 checks it (its statuses and texts, side by side).

Settings are layered: the command line's, under the fleet's global ones, under a model's own
(`null` drops a model's own value, which then follows the global one again). An update is all
or nothing: every key is parsed, then the whole checked, as Triton does.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

LEVELS = ("TIMESTAMPS", "TENSORS")
MODES = ("triton", "opentelemetry")
UINT32 = 2**32
#: the keys an update may carry, as /v2/trace/setting names them.
KEYS = ("trace_level", "trace_rate", "trace_count", "log_frequency")
#: OpenTelemetry's exporter settings, as --trace-config opentelemetry,<name>= sets them.
DEFAULT_URL = "http://localhost:4318/v1/traces"
BSP_SETTINGS = ("bsp_max_queue_size", "bsp_schedule_delay", "bsp_max_export_batch_size")


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
    #: mode=opentelemetry: where spans go (OTLP over HTTP), the resource's `key=value`s and
    #: the batch span processor's bounds (queue size, delay in ms, export batch size).
    url: str = DEFAULT_URL
    resource: tuple[str, ...] = ()
    bsp_max_queue_size: int = 2048
    bsp_schedule_delay: int = 5000
    bsp_max_export_batch_size: int = 512

    @property
    def on(self) -> bool:
        return bool(self.level) and self.count != 0 and self.rate > 0

    @property
    def opentelemetry(self) -> bool:
        return self.mode == "opentelemetry"

    def to_json(self) -> dict[str, Any]:
        """As /v2/trace/setting answers: every value a string, the level a list; in
        OpenTelemetry mode the exporter's settings in place of the file's, in tritonserver
        2.51's order."""
        head = {
            "trace_level": sorted(self.level) or ["OFF"],
            "trace_rate": str(self.rate),
            "trace_count": str(self.count),
        }
        if not self.opentelemetry:
            return {
                **head,
                "log_frequency": str(self.log_frequency),
                "trace_file": self.file,
                "trace_mode": self.mode,
            }
        exporter = {"trace_mode": self.mode, "url": self.url}
        exporter["bsp_schedule_delay"] = str(self.bsp_schedule_delay)
        if self.resource:
            exporter["resource"] = ",".join(self.resource)
        exporter["bsp_max_export_batch_size"] = str(self.bsp_max_export_batch_size)
        exporter["bsp_max_queue_size"] = str(self.bsp_max_queue_size)
        return {**head, **exporter}

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
        try:
            settings = _setting(settings, name, value)
        except ValueError as exc:
            raise ValueError(f"--trace-config {entry}: {exc}") from None
    if settings.opentelemetry and not _sdk_installed():
        raise ValueError(
            "--trace-config mode=opentelemetry needs the OpenTelemetry SDK: "
            "pip install 'sluice-serve[otel]'"
        )
    try:
        return settings.checked()
    except TraceSettingsError as exc:
        raise ValueError(f"--trace-config: {exc}") from None


def _setting(settings: TraceSettings, name: str, value: str) -> TraceSettings:
    if name in ("url", "resource", *BSP_SETTINGS):
        return _exporter_setting(settings, name, value)
    if name == "mode":
        if value not in MODES:
            raise ValueError("mode must be triton or opentelemetry")
        return dataclasses.replace(settings, mode=value)
    if name == "file":
        return dataclasses.replace(settings, file=value)
    if name == "level":
        if value != "OFF" and value not in LEVELS:
            raise ValueError("level must be OFF, TIMESTAMPS, TENSORS")
        level = frozenset() if value == "OFF" else settings.level | {value}
        return dataclasses.replace(settings, level=level)
    if name in ("rate", "count", "log-frequency"):
        key = {"rate": "trace_rate", "count": "trace_count"}.get(name, "log_frequency")
        try:
            number = _number(key, value)
        except TraceSettingsError as exc:
            raise ValueError(str(exc)) from None
        return settings.with_values({name.replace("-", "_"): number})
    raise ValueError(f"unknown setting '{name}'")


def _exporter_setting(settings: TraceSettings, name: str, value: str) -> TraceSettings:
    """OpenTelemetry's: the OTLP endpoint, a resource attribute, the batch processor's bounds."""
    if name == "url":
        return dataclasses.replace(settings, url=value)
    if name == "resource":
        if "=" not in value:
            raise ValueError("expected resource=<key>=<value>")
        return dataclasses.replace(settings, resource=(*settings.resource, value))
    try:
        number = int(value)
    except ValueError:
        raise ValueError("expected a number") from None
    if number < 1:
        raise ValueError("must be at least 1")
    bound: dict[str, Any] = {name: number}
    return dataclasses.replace(settings, **bound)


def _sdk_installed() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None
    except ModuleNotFoundError:
        return False
