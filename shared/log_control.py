"""A process's logging held to Triton's logging settings, and following the fleet's.

`log_info`, `log_warning` and `log_error` let records of their level through or not;
`log_verbose_level` 1 lets sluice's debug records through, 2 or more its libraries' too;
`log_format` ISO8601 stamps lines in UTC as Triton does. Each gateway and worker reads the
fleet's settings (`keys.LOG_SETTINGS`, written by any gateway's `/v2/logging`) every
`FOLLOW_INTERVAL_S`, so a change reaches the whole fleet within that.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

from sluice.shared import keys
from sluice.shared.log_settings import LogFormat, LogSettings
from sluice.shared.redis_client import REDIS_ERRORS

FOLLOW_INTERVAL_S = 1.0
LINE = "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
ISO8601 = "%Y-%m-%dT%H:%M:%SZ"

log = logging.getLogger(__name__)


class _Levels(logging.Filter):
    """Lets a record through when its level's setting is on."""

    def __init__(self) -> None:
        super().__init__("sluice-log-settings")
        self.settings = LogSettings()

    def filter(self, record: logging.LogRecord) -> bool:
        settings, level = self.settings, record.levelno
        if level >= logging.ERROR:
            return settings.log_error
        if level >= logging.WARNING:
            return settings.log_warning
        if level >= logging.INFO:
            return settings.log_info
        return settings.log_verbose_level > 0


def _formatter(shape: LogFormat) -> logging.Formatter:
    if shape == "default":
        return logging.Formatter(LINE)
    formatter = logging.Formatter(LINE, ISO8601)
    formatter.converter = time.gmtime
    return formatter


class LogControl:
    """The process's logging and the settings it follows: `baseline` from its command line,
    under the fleet's."""

    def __init__(self, baseline: LogSettings, attached: bool = True) -> None:
        self.baseline = baseline
        #: whether `apply` touches the process's logging (not for a gateway run inside
        #: another program, whose logging is the program's own)
        self.attached = attached
        self.settings = baseline
        self._levels = _Levels()
        #: the handlers this control made (their format follows `log_format`).
        self._handlers: list[logging.Handler] = []

    def install(self) -> None:
        """Log to stderr (and to `log_file`, when given) under these settings."""
        self._handlers.append(logging.StreamHandler(sys.stderr))
        if self.baseline.log_file:
            self._handlers.append(logging.FileHandler(self.baseline.log_file))
        root = logging.getLogger()
        for handler in self._handlers:
            root.addHandler(handler)
        self.apply(self.baseline)

    def apply(self, settings: LogSettings) -> None:
        """Take `settings` now: every handler of the root logger filters by them."""
        changed_format = settings.log_format != self.settings.log_format
        self.settings = self._levels.settings = settings
        if not self.attached:
            return
        root = logging.getLogger()
        verbose = settings.log_verbose_level
        # level 1: sluice's own debug records; 2 and up: its libraries' too (chatty: hpack
        # logs each header it decodes)
        logging.getLogger("sluice").setLevel(logging.DEBUG if verbose > 0 else logging.NOTSET)
        root.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
        for handler in root.handlers:
            if self._levels not in handler.filters:
                handler.addFilter(self._levels)
        if changed_format or not all(h.formatter for h in self._handlers):
            for handler in self._handlers:
                handler.setFormatter(_formatter(settings.log_format))

    def under_fleet(self, fields: dict[Any, bytes]) -> LogSettings:
        """The baseline under the fleet hash's `fields`, taken now."""
        settings = self.baseline.with_fleet(fields)
        if settings != self.settings:
            self.apply(settings)
        return settings

    async def follow(self, redis: Any) -> None:
        """Take the fleet's settings every FOLLOW_INTERVAL_S, until cancelled; Redis being
        away only postpones it."""
        while True:
            try:
                self.under_fleet(await redis.hgetall(keys.LOG_SETTINGS))
            except REDIS_ERRORS as exc:
                log.debug("log settings not read: %s", exc)
            await asyncio.sleep(FOLLOW_INTERVAL_S)


_installed: LogControl | None = None


def install(baseline: LogSettings) -> LogControl:
    """The command line's logging for this process (once)."""
    global _installed
    _installed = LogControl(baseline)
    _installed.install()
    return _installed


def process_control() -> LogControl:
    """This process's control: the installed one, else a detached one that keeps the settings
    but leaves the logging alone (a gateway or worker run inside another program, as in the
    tests, whose logging is that program's)."""
    global _installed
    if _installed is None:
        _installed = LogControl(LogSettings(), attached=False)
    return _installed
