"""What one bench run does, parsed from the command line once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sluice.options import Settings, SettingsError, at_least, option

Mode = Literal["concurrency", "request_rate"]


@dataclass(frozen=True, slots=True)
class Target:
    host: str
    port: int
    model: str
    auth_token: str | None = None

    @property
    def authority(self) -> str:
        return f"{self.host}:{self.port}"


DEFAULT_CONCURRENCY = (1, 8, 32, 64)


def _levels_of_int(text: str) -> tuple[float, ...]:
    return parse_levels(text, integer=True)


def _levels_of_float(text: str) -> tuple[float, ...]:
    return parse_levels(text, integer=False)


def _url_problem(url: str) -> str | None:
    try:
        parse_url(url)
    except ValueError as exc:
        return str(exc)
    return None


def _levels_problem(levels: tuple[float, ...]) -> str | None:
    return None if levels and all(level > 0 for level in levels) else "levels must be positive"


@dataclass(frozen=True, kw_only=True)
class BenchSettings(Settings):
    """`sluice bench`: each field is one of its options."""

    url: str = option(
        "127.0.0.1:8000",
        help="KServe v2 HTTP endpoint (host:port) of sluice, Triton or any compatible server.",
        env="SLUICE_BENCH_URL",
        check=_url_problem,
    )
    model: str = option(help="Model to send load to.", env="SLUICE_BENCH_MODEL")
    concurrency: tuple[float, ...] | None = option(
        None,
        help="Comma-separated concurrencies to sweep: that many connections, each sending its "
        "next request when the last is answered (default 1,8,32,64).",
        env="SLUICE_BENCH_CONCURRENCY",
        parse=_levels_of_int,
        check=_levels_problem,
    )
    request_rate: tuple[float, ...] | None = option(
        None,
        help="Comma-separated request rates (req/s) to sweep instead: requests are sent on "
        "schedule whatever the answers (open loop).",
        env="SLUICE_BENCH_REQUEST_RATE",
        parse=_levels_of_float,
        check=_levels_problem,
    )
    distribution: Literal["constant", "poisson"] = option(
        "constant",
        help="Intervals between scheduled requests with --request-rate.",
        env="SLUICE_BENCH_DISTRIBUTION",
    )
    batch_size: int = option(
        1,
        help="Rows per request (the leading dim of every input when the model batches).",
        env="SLUICE_BENCH_BATCH_SIZE",
        check=at_least(1),
    )
    input_data: Literal["random", "zeros"] = option(
        "random",
        help="Tensor contents, shaped from the model's metadata (variable dims become 1).",
        env="SLUICE_BENCH_INPUT_DATA",
    )
    binary: bool = option(
        True,
        help="Send tensors with the binary tensor extension, or as JSON.",
        flag="--binary/--json",
        env="SLUICE_BENCH_BINARY",
    )
    window_ms: int = option(
        3000,
        help="Length of one measurement window.",
        env="SLUICE_BENCH_WINDOW_MS",
        check=at_least(1),
    )
    stability_percent: float = option(
        20.0,
        help="A level is done when its last 3 windows are within this of each other's mean, "
        "for throughput and p95 latency.",
        env="SLUICE_BENCH_STABILITY_PERCENT",
        check=at_least(0),
    )
    max_trials: int = option(
        10,
        help="Windows per level at most; the last 3 are reported even when not stable.",
        env="SLUICE_BENCH_MAX_TRIALS",
        check=at_least(1),
    )
    warmup_s: float = option(
        1.0,
        help="Seconds of load at each level before its first window.",
        env="SLUICE_BENCH_WARMUP_S",
        check=at_least(0),
    )
    json_out: Path | None = option(
        None, help="Write every window and result as JSON here.", env="SLUICE_BENCH_JSON_OUT"
    )
    plot_out: Path | None = option(
        None,
        help="Write a PNG of latency vs throughput and batch sizes here (needs matplotlib: "
        "pip install 'sluice-serve[bench]').",
        env="SLUICE_BENCH_PLOT_OUT",
    )
    auth_token: str | None = option(
        None, help="Send 'Authorization: Bearer <token>' with every request."
    )
    #: where the load goes, from url, model and auth_token.
    target: Target = field(init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.concurrency and self.request_rate:
            raise SettingsError(
                "--request-rate", "--request-rate: give it or --concurrency, not both"
            )
        host, port = parse_url(self.url)
        object.__setattr__(self, "target", Target(host, port, self.model, self.auth_token))

    @property
    def mode(self) -> Mode:
        return "request_rate" if self.request_rate else "concurrency"

    @property
    def levels(self) -> tuple[float, ...]:
        """Concurrencies or request rates (req/s), one load level each."""
        return self.request_rate or self.concurrency or DEFAULT_CONCURRENCY

    @property
    def window_s(self) -> float:
        return self.window_ms / 1e3


def parse_url(url: str) -> tuple[str, int]:
    """`host:port` or `http://host:port[/]` -> (host, port); HTTPS is not spoken."""
    if url.startswith("https://"):
        raise ValueError("https is not supported; point --url at a plain HTTP endpoint")
    rest = url.removeprefix("http://").rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep:
        return rest, 80
    if not port.isdigit() or not host:
        raise ValueError(f"expected host:port, got '{url}'")
    return host.strip("[]"), int(port)


def parse_levels(text: str, *, integer: bool) -> tuple[float, ...]:
    """`1,8,32` -> (1, 8, 32); every level must be positive."""
    levels: list[float] = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            value = int(part) if integer else float(part)
        except ValueError:
            raise ValueError(f"'{part.strip()}' is not a number") from None
        if value <= 0:
            raise ValueError(f"levels must be positive, got {value}")
        levels.append(value)
    if not levels:
        raise ValueError("no load levels given")
    return tuple(levels)
