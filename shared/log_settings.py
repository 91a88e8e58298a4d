"""Triton's logging extension: the settings, and an update checked as tritonserver 2.51 checks it.

The settings are fleet-wide: an update is written to one Redis hash (`keys.LOG_SETTINGS`),
which every gateway and worker follows (shared/log_control.py). `log_file` stays each
process's own (`--log-file`), and the network cannot change it, as in Triton.

Triton applies an update's keys in a fixed order (file, info, warning, error, verbose level,
format) and stops at the first bad one, keeping those before it: so does `updated`. Its status
codes are Triton's too, odd as some are (a bad format is a 503, a value of the wrong type 500).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

LogFormat = Literal["default", "ISO8601"]
FORMATS: tuple[LogFormat, ...] = ("default", "ISO8601")
#: the keys an update may change over the network, in the order Triton applies them.
FLAGS = ("log_info", "log_warning", "log_error")


class LogSettingsError(Exception):
    """An update Triton refuses: `kind` picks the status (HTTP and gRPC) it answers with."""

    def __init__(self, kind: Literal["file", "format", "type"], message: str) -> None:
        super().__init__(message)
        self.kind = kind


FILE_FIXED = "log file location can not be updated through network protocol"
NOT_BOOLEAN = "attempt to access JSON non-boolean as boolean"
NOT_UNSIGNED = "attempt to access JSON non-unsigned-integer as unsigned-integer"


@dataclass(frozen=True, slots=True)
class LogSettings:
    log_file: str = ""
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: LogFormat = "default"

    @classmethod
    def from_level(
        cls, level: str, log_file: str = "", log_format: LogFormat = "default"
    ) -> LogSettings:
        """What `--log-level` means in Triton's terms (debug: verbose level 1)."""
        rank = ("debug", "info", "warning", "error").index(level.lower())
        return cls(
            log_file=log_file,
            log_info=rank <= 1,
            log_warning=rank <= 2,
            log_error=True,
            log_verbose_level=1 if rank == 0 else 0,
            log_format=log_format,
        )

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def updated(self, changes: Mapping[str, Any]) -> tuple[LogSettings, LogSettingsError | None]:
        """These settings with `changes` (JSON values) applied in Triton's order, up to the
        first it refuses, and that refusal (None: all applied). Unknown keys are ignored."""
        settings = self
        try:
            if "log_file" in changes:
                raise LogSettingsError("file", FILE_FIXED)
            for flag in FLAGS:
                if flag in changes:
                    value = changes[flag]
                    if not isinstance(value, bool):
                        raise LogSettingsError("type", NOT_BOOLEAN)
                    flags: dict[str, Any] = {flag: value}
                    settings = dataclasses.replace(settings, **flags)
            if "log_verbose_level" in changes:
                level = changes["log_verbose_level"]
                if isinstance(level, bool) or not isinstance(level, int) or level < 0:
                    raise LogSettingsError("type", NOT_UNSIGNED)
                settings = dataclasses.replace(settings, log_verbose_level=min(level, 2**32 - 1))
            if "log_format" in changes:
                shape = changes["log_format"]
                if shape not in FORMATS:
                    raise LogSettingsError(
                        "format", f"invalid argument for --log_format, got: {shape}"
                    )
                settings = dataclasses.replace(settings, log_format=shape)
        except LogSettingsError as exc:
            return settings, exc
        return settings, None

    def fleet_fields(self, since: LogSettings) -> dict[str, bytes]:
        """The fleet hash's fields that differ from `since` (log_file is not fleet-wide)."""
        return {
            name: orjson.dumps(value)
            for name, value in self.to_json().items()
            if name != "log_file" and value != getattr(since, name)
        }

    def with_fleet(self, fields: Mapping[bytes | str, bytes]) -> LogSettings:
        """These settings (a process's own, from its command line) under the fleet hash's;
        a field that does not parse as its kind is skipped."""
        changes = {}
        for raw_name, raw_value in fields.items():
            name = raw_name.decode() if isinstance(raw_name, bytes) else raw_name
            if name == "log_file":
                continue
            try:
                changes[name] = orjson.loads(raw_value)
            except orjson.JSONDecodeError:
                continue
        settings = self
        for name in (*FLAGS, "log_verbose_level", "log_format"):
            if name in changes:
                settings, _ = settings.updated({name: changes[name]})
        return settings
