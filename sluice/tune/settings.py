"""What one `sluice tune` run does, parsed from the command line once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluice.bench.settings import parse_levels, parse_url
from sluice.options import Settings, SettingsError, at_least, option, positive

DEFAULT_DELAYS_US = (0, 100, 500, 1000, 2000, 5000)
DEFAULT_INSTANCES = (1, 2, 4)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(level) for level in parse_levels(text, integer=True))


def _delays(text: str) -> tuple[int, ...]:
    """Delays may be 0 (no wait), which parse_levels refuses."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"'{text}' is not a list of microseconds") from None
    if not values or min(values) < 0:
        raise ValueError("delays must be 0 or more")
    return values


def _url_problem(url: str | None) -> str | None:
    try:
        parse_url(url or "")
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True, kw_only=True)
class TuneSettings(Settings):
    """`sluice tune`: each field is one of its options."""

    model: str = option(help="Model to tune.", env="SLUICE_TUNE_MODEL")
    p99_ms: float = option(
        help="Latency objective: p99 at or below this.", check=positive, env="SLUICE_TUNE_P99_MS"
    )
    model_repository: Path | None = option(
        None,
        help="Repository to serve the model from: tune runs its own `sluice serve` on it "
        "(embedded Redis, explicit model control) and stops it at the end.",
        env="SLUICE_TUNE_MODEL_REPOSITORY",
    )
    url: str | None = option(
        None,
        help="Tune on a running fleet instead (host:port of a gateway; its "
        "--model-control-mode must be explicit). The model's original config is loaded "
        "back at the end.",
        check=_url_problem,
        env="SLUICE_TUNE_URL",
    )
    min_throughput: float = option(
        0.0,
        help="Throughput floor (infer/s) a pick must also reach.",
        check=at_least(0),
        env="SLUICE_TUNE_MIN_THROUGHPUT",
    )
    budget_s: float = option(
        600.0,
        help="Time budget of the whole run, the server's start included.",
        check=positive,
        env="SLUICE_TUNE_BUDGET_S",
    )
    price_per_hour: float | None = option(
        None,
        help="Price of one worker per hour: the table then shows cost per million "
        "inferences at the objective (set the same on workers for the dashboard).",
        check=positive,
        env="SLUICE_TUNE_PRICE_PER_HOUR",
    )
    workers: int = option(
        1,
        help="Worker processes serving the model (tune's own serve starts this many); cost "
        "counts each.",
        check=at_least(1),
        env="SLUICE_TUNE_WORKERS",
    )
    max_concurrency: int = option(
        64,
        help="Highest concurrency of a candidate's ramp (1, 2, 4, ...).",
        check=at_least(1),
        env="SLUICE_TUNE_MAX_CONCURRENCY",
    )
    max_batch_sizes: tuple[int, ...] | None = option(
        None,
        help="max_batch_size values to try (default: powers of two up to the model's own).",
        parse=_ints,
        env="SLUICE_TUNE_MAX_BATCH_SIZES",
    )
    delays_us: tuple[int, ...] | None = option(
        None,
        help="max_queue_delay_microseconds values to try (default 0,100,500,1000,2000,5000).",
        parse=_delays,
        env="SLUICE_TUNE_DELAYS_US",
    )
    instances: tuple[int, ...] | None = option(
        None,
        help="instance_group counts to try (default 1,2,4).",
        parse=_ints,
        env="SLUICE_TUNE_INSTANCES",
    )
    window_ms: int = option(
        1000,
        help="Length of one measurement window.",
        check=at_least(1),
        env="SLUICE_TUNE_WINDOW_MS",
    )
    max_trials: int = option(
        4,
        help="Windows per concurrency at most (3 that agree end it sooner).",
        check=at_least(3),
        env="SLUICE_TUNE_MAX_TRIALS",
    )
    warmup_s: float = option(
        0.5,
        help="Load before a level's first window.",
        check=at_least(0),
        env="SLUICE_TUNE_WARMUP_S",
    )
    out_dir: Path = option(
        Path("sluice-tune"),
        help="Where the table, pareto.png, config.pbtxt, the state file (a rerun resumes "
        "from it) and the server's log go.",
        env="SLUICE_TUNE_OUT_DIR",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.model_repository is None) == (self.url is None):
            raise SettingsError("--url", "--url or --model-repository: give one of them")
