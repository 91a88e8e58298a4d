"""What one bench run does, parsed from the command line once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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


@dataclass(frozen=True, slots=True)
class BenchSettings:
    target: Target
    mode: Mode
    #: concurrencies or request rates (req/s), one load level each
    levels: tuple[float, ...]
    distribution: Literal["constant", "poisson"] = "constant"
    batch_size: int = 1
    input_data: Literal["random", "zeros"] = "random"
    binary: bool = True
    window_s: float = 3.0
    stability_percent: float = 20.0
    max_trials: int = 10
    warmup_s: float = 1.0


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
