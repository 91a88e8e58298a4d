"""How `sluice status` and `sluice jobs` find a local `sluice serve` without --redis-url.

The embedded Redis of `serve` listens on a random Unix socket, and a guessed
`redis://127.0.0.1:6379` reaches whatever else listens there. So each running `serve` writes
a small JSON file (its Redis URL, pid, ports and model repository) into a per-user runtime
directory and removes it on exit; a file whose process is gone (a serve that was killed) is
ignored and removed. With several serves on the machine, the one serving the repository the
command runs in is taken; otherwise none is guessed: they are listed, with how to choose.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from sluice.preflight import shown_url


@dataclass(frozen=True, slots=True)
class ServeRecord:
    pid: int
    redis_url: str
    http: str
    metrics: str
    started: float
    #: the model repository, absolute ("" in a file written by an older serve).
    repository: str = ""


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


Command = TypeVar("Command", bound=Callable[..., Any])


def local_serve_options(command: Command) -> Command:
    """--redis-url, and --serve-pid to pick among the local serves when it is left out."""
    url = click.option(
        "--redis-url",
        envvar="SLUICE_REDIS_URL",
        show_envvar=True,
        default=None,
        help="Redis the fleet queues on (default: that of the sluice serve running on this "
        "machine).",
    )
    pid = click.option(
        "--serve-pid",
        type=int,
        envvar="SLUICE_SERVE_PID",
        show_envvar=True,
        default=None,
        help="The local sluice serve to use when several run (default: the one whose model "
        "repository holds the working directory, or the only one).",
    )
    return url(pid(command))


def _nearness(record: ServeRecord, here: Path) -> tuple[int, int] | None:
    """How closely a serve belongs to the working directory: its repository holds `here`
    (the deepest such repository nearest), or `here` holds its repository; None if neither."""
    if not record.repository:
        return None
    repository = Path(record.repository)
    if here.is_relative_to(repository):
        return (2, len(repository.parts))
    if repository.is_relative_to(here):
        return (1, 0)
    return None


def _listing(serves: list[ServeRecord]) -> str:
    """One line per serve: what a person needs to tell them apart."""
    return "\n".join(
        f"  pid {s.pid}  {s.repository or '?'}  {shown_url(s.redis_url)}  http://{s.http}  "
        f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(s.started))}"
        for s in serves
    )


def choose_serve(serves: list[ServeRecord], here: Path, pid: int | None) -> ServeRecord:
    """The serve with `pid`; else the only one; else the one whose repository is nearest `here`
    (see `_nearness`); a clear error, listing them, when that leaves a choice."""
    if pid is not None:
        chosen = [s for s in serves if s.pid == pid]
        if chosen:
            return chosen[0]
        raise click.ClickException(
            f"--serve-pid {pid}: no sluice serve runs on this machine with that pid; "
            f"running:\n{_listing(serves)}"
        )
    if len(serves) == 1:
        return serves[0]
    nearness = {s.pid: _nearness(s, here) for s in serves}
    best = max((n for n in nearness.values() if n is not None), default=None)
    nearest = [s for s in serves if best is not None and nearness[s.pid] == best]
    if len(nearest) == 1:
        return nearest[0]
    raise click.ClickException(
        f"{len(serves)} sluice serve processes run on this machine; choose one with "
        f"--serve-pid PID (or SLUICE_SERVE_PID), or with --redis-url URL, or run this command "
        f"in its model repository:\n{_listing(serves)}"
    )


def redis_url_or_local(redis_url: str | None, serve_pid: int | None) -> str:
    """`redis_url` when given, else the Redis of the local serve `choose_serve` picks (which
    one, on stderr, when several run); a clear error if none runs."""
    if redis_url:
        return redis_url
    serves = running_serves()
    if not serves:
        raise click.ClickException(
            "no sluice serve is running on this machine: start one, or pass --redis-url "
            "(or SLUICE_REDIS_URL) to reach a fleet's Redis"
        )
    chosen = choose_serve(serves, Path.cwd().resolve(), serve_pid)
    if len(serves) > 1:
        click.echo(
            f"using the sluice serve of {chosen.repository} (pid {chosen.pid}, "
            f"http://{chosen.http})",
            err=True,
        )
    return chosen.redis_url
