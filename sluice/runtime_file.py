"""How `sluice status` and `sluice jobs` find a local `sluice serve` without --redis-url.

The embedded Redis of `serve` listens on a random Unix socket, and a guessed
`redis://127.0.0.1:6379` reaches whatever else listens there. So each running `serve` writes
a small JSON file (its Redis URL, pid and ports) into a per-user runtime directory and removes
it on exit; a file whose process is gone (a serve that was killed) is ignored and removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import click


@dataclass(frozen=True, slots=True)
class ServeRecord:
    pid: int
    redis_url: str
    http: str
    metrics: str
    started: float


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/sluice, else a per-user folder in the temporary directory."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return Path(base) / "sluice"
    return Path(tempfile.gettempdir()) / f"sluice-{os.getuid()}"


def _own_dir() -> Path:
    """The runtime directory, made private to this user (it names a Redis without a password)."""
    path = runtime_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user")
    return path


def _path(pid: int) -> Path:
    return runtime_dir() / f"serve-{pid}.json"


def write(record: ServeRecord) -> Path:
    path = _own_dir() / f"serve-{record.pid}.json"
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(asdict(record)))
    temporary.replace(path)  # readers never see half a file
    return path


def remove(pid: int | None = None) -> None:
    """Remove this process's record (or `pid`'s); safe from any thread, and when absent."""
    with contextlib.suppress(OSError):
        _path(os.getpid() if pid is None else pid).unlink()


def _is_serve(pid: int) -> bool:
    """Whether `pid` is alive and still a sluice process (pids are reused)."""
    try:
        return b"sluice" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def running_serves() -> list[ServeRecord]:
    """Every live local serve, newest first; stale records are removed on the way."""
    found = []
    for path in runtime_dir().glob("serve-*.json"):
        try:
            record = ServeRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if _is_serve(record.pid):
            found.append(record)
        else:
            remove(record.pid)
    return sorted(found, key=lambda r: r.started, reverse=True)


def redis_url_or_local(redis_url: str | None) -> str:
    """`redis_url` when given, else the Redis of the newest local serve; a clear error if none."""
    if redis_url:
        return redis_url
    serves = running_serves()
    if not serves:
        raise click.ClickException(
            "no sluice serve is running on this machine: start one, or pass --redis-url "
            "(or SLUICE_REDIS_URL) to reach a fleet's Redis"
        )
    if len(serves) > 1:
        click.echo(
            f"{len(serves)} sluice serve processes are running; using the newest "
            f"(pid {serves[0].pid}, http://{serves[0].http})",
            err=True,
        )
    return serves[0].redis_url
