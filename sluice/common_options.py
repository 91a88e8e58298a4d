"""The options every sluice role shares: where Redis is and its password, logging, Triton's
trace settings, idle polling and model control; and the helpers the roles' options are built
with (sluice.settings puts them together per role)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from sluice.options import Check, Settings, SettingsError, at_least, option
from sluice.preflight import shown_url, unknown_scheme
from sluice.secret_options import one_secret, with_password
from sluice.shared.drain_deadline import DEFAULT_DRAIN_TIMEOUT_S, DRAIN_TIMEOUT_HELP
from sluice.shared.idle_poll import DEFAULT_WINDOW_US
from sluice.shared.log_settings import LogFormat
from sluice.shared.repository_control import ControlMode
from sluice.shared.trace_settings import parse_trace_config

LogLevel = Literal["debug", "info", "warning", "error"]

REDIS_URL_HELP = (
    "Redis to queue on (redis://, rediss://, unix://, redis+sentinel://h1:p1,h2:p2/<master>)."
)

#: the ways to give a secret that keep it out of `ps`, for the help of options that take one.
OUT_OF_ARGV = "(the command line shows in `ps`: prefer {} or {})"


def redis_url(help: str, default: Any = MISSING) -> Any:
    """The --redis-url option; required unless given a default."""
    return option(default, help=help, check=unknown_scheme, shown=shown_url)


def comma_list(text: str) -> tuple[str, ...] | None:
    """`a, b` -> ("a", "b"); an empty list is None (every model)."""
    return tuple(m.strip() for m in text.split(",") if m.strip()) or None


def secret_help(text: str, variable: str, file_flag: str) -> str:
    return f"{text} {OUT_OF_ARGV.format(variable, file_flag)}"


def parses(parse: Callable[[tuple[str, ...]], object]) -> Check:
    """A check that says what `parse` finds wrong with an option's values (its ValueError)."""

    def check(specs: tuple[str, ...]) -> str | None:
        try:
            parse(specs)
        except ValueError as exc:
            return str(exc)
        return None

    return check


@dataclass(frozen=True, kw_only=True)
class RedisPassword(Settings):
    """The Redis password apart from --redis-url, folded into the URL once built (the
    settings a parent hands its children carry the URL alone)."""

    redis_password: str | None = option(
        None,
        help=secret_help(
            "Password of the --redis-url's Redis.",
            "SLUICE_REDIS_PASSWORD",
            "--redis-password-file",
        ),
    )
    redis_password_file: Path | None = option(
        None, help="A file holding the Redis password (its line end dropped)."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        password = one_secret(
            self.redis_password,
            self.redis_password_file,
            "--redis-password",
            "--redis-password-file",
        )
        if password is None:
            return
        url: str | None = getattr(self, "redis_url", None)
        if url is None:
            message = "--redis-password: needs --redis-url (the embedded Redis takes none)"
            raise SettingsError("--redis-password", message)
        if urlsplit(url).password is not None:
            message = f"--redis-password: --redis-url {shown_url(url)} holds one already"
            raise SettingsError("--redis-password", message)
        object.__setattr__(self, "redis_url", with_password(url, password))
        object.__setattr__(self, "redis_password", None)
        object.__setattr__(self, "redis_password_file", None)


@dataclass(frozen=True, kw_only=True)
class ProcessSettings(Settings):
    """What every long-running sluice process takes."""

    log_level: LogLevel = option(
        "info",
        help="Log level: Triton's log_info, log_warning and log_error, and debug as "
        "log_verbose_level 1 (all changeable fleet-wide through /v2/logging).",
    )
    log_file: Path | None = option(
        None,
        help="Also log to this file (Triton's --log-file: /v2/logging shows it, never changes it).",
    )
    log_format: LogFormat = option(
        "default", help="Line format: 'default', or 'ISO8601' for UTC timestamps as Triton's."
    )
    drain_timeout_s: float = option(
        DEFAULT_DRAIN_TIMEOUT_S, help=DRAIN_TIMEOUT_HELP, old="--drain-timeout", check=at_least(0)
    )


@dataclass(frozen=True, kw_only=True)
class TraceOptions(Settings):
    """Triton's trace extension: what gateways sample, and where they and workers send it."""

    trace_config: tuple[str, ...] = option(
        (),
        help="Triton's trace extension, [<mode>,]<setting>=<value> (repeat to add): "
        "level=TIMESTAMPS, rate=<every Nth request> (1000), count=<traces> (-1: no limit); "
        "mode=triton (default) with file=<path> (a JSON array, as Triton's) and "
        "log-frequency=<traces per file> (0: at stop); mode=opentelemetry with "
        "url=<OTLP/HTTP endpoint> (http://localhost:4318/v1/traces), resource=<key>=<value> "
        "and bsp_max_queue_size / bsp_schedule_delay (ms) / bsp_max_export_batch_size. "
        "Workers need the same OpenTelemetry settings to add their spans. Rate, count and "
        "level change fleet-wide at run time through /v2/trace/setting.",
        repeat=True,
        check=parses(parse_trace_config),
        shown=" ".join,
    )


@dataclass(frozen=True, kw_only=True)
class IdlePolling(Settings):
    """Both a gateway and a worker poll for a while after work at low load."""

    idle_poll_us: int = option(
        DEFAULT_WINDOW_US,
        help="Microseconds a gateway with one request in flight, or a worker after a batch run "
        "at low load, keeps polling before it sleeps: saves CPU wake-ups on a lone request's "
        "path where idle CPUs halt (VMs), at the cost of CPU at low load only. 0: sleep at once.",
        check=at_least(0),
    )


@dataclass(frozen=True, kw_only=True)
class ModelControl(Settings):
    """Triton's model control mode: the workers load by it, the gateways answer the
    repository's load and unload calls by it."""

    model_control_mode: ControlMode = option(
        "none",
        help="Triton's model control: 'none' loads every model at start and refuses load/unload "
        "calls; 'poll' also follows the repository's changes every --repository-poll-secs; "
        "'explicit' loads only --load-model's models at start, then what load/unload calls say, "
        "fleet-wide.",
    )
