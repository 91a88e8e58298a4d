"""Start-up mistakes found before anything starts: one line naming the option, exit status 2.

A busy port found once Redis and the workers were up used to end in a long traceback with
processes to tear down. Each check here runs before serve starts its embedded Redis or any
child, so nothing is left running when one fails.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import click

from sluice.shared.redis_client import CONNECTION_ERRORS, REDIS_ERRORS, SENTINEL_SCHEME, sync_client

#: the exit status of a start-up mistake (click's usage errors use it too).
STARTUP_ERROR_STATUS = 2
REDIS_SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME)
#: what a worker imports beyond the base install (gateway, SDK, command line): the
#: `sluice-serve[worker]` extra.
WORKER_MODULES = ("torch", "tritonclient", "google.protobuf")


class StartupError(click.ClickException):
    """`sluice: --http-port 8000: address already in use` on stderr, exit status 2."""

    exit_code = STARTUP_ERROR_STATUS

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"sluice: {self.message}", err=True)


def _reason(exc: OSError) -> str:
    text = os.strerror(exc.errno) if exc.errno else str(exc)
    return text[:1].lower() + text[1:]


def check_port(host: str, port: int, option: str) -> None:
    """Bind `host:port` as the server will (SO_REUSEADDR), then let it go."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"--host {host}: {exc.strerror.lower()}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise StartupError(f"{option} {port}: {_reason(exc)}") from None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def check_installed(command: str, extra: str) -> None:
    """The worker's packages are there: the base install has no torch, and a worker without
    it would end in an ImportError traceback instead of the install to run."""
    missing = [module for module in WORKER_MODULES if not _installed(module)]
    if missing:
        raise StartupError(
            f"{command} runs models and needs {', '.join(missing)}: "
            f"pip install 'sluice-serve[{extra}]'"
        )


def check_repository(path: Path, option: str = "--model-repository") -> None:
    """A readable directory holding at least one model: a folder with a `config.pbtxt` or a
    version folder (a model without config.pbtxt is auto-completed, as Triton's)."""
    # model_config brings protobuf and tritonclient, which only the worker extra installs
    from sluice.shared.model_config import CONFIG_FILENAME

    if not path.exists():
        raise StartupError(f"{option} {path}: no such directory")
    if not path.is_dir():
        raise StartupError(f"{option} {path}: not a directory")
    try:
        folders = [p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")]
        holds_model = any(
            (p / CONFIG_FILENAME).is_file()
            or any(v.is_dir() and v.name.isdigit() for v in p.iterdir())
            for p in folders
        )
    except OSError as exc:
        raise StartupError(f"{option} {path}: cannot read it ({_reason(exc)})") from None
    if not holds_model:
        raise StartupError(
            f"{option} {path}: model repository {path} holds no model "
            f"(expected <model>/<version>/ and, unless its files say, <model>/{CONFIG_FILENAME})"
        )


def shown_url(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def unknown_scheme(url: str) -> str | None:
    """What is wrong with a Redis URL's scheme, if anything. gateway and worker check no more:
    they wait for a Redis that is not up yet (as through an outage), so a fleet starts in any
    order."""
    scheme = urlsplit(url).scheme
    if scheme in REDIS_SCHEMES:
        return None
    known = ", ".join(f"{s}://" for s in REDIS_SCHEMES)
    return f"unknown scheme {scheme!r} (use {known})"


def check_redis_url(url: str, option: str = "--redis-url") -> None:
    """A URL of a scheme sluice knows."""
    problem = unknown_scheme(url)
    if problem:
        raise StartupError(f"{option} {shown_url(url)}: {problem}")


def check_redis(url: str, option: str = "--redis-url") -> None:
    """A URL sluice can use, of a Redis that answers PING (serve: the user means it now)."""
    check_redis_url(url, option)
    shown = shown_url(url)
    try:
        client = sync_client(url)
    except (ValueError, *REDIS_ERRORS) as exc:
        raise StartupError(f"{option} {shown}: {exc}") from None
    try:
        client.ping()
    except CONNECTION_ERRORS as exc:
        raise StartupError(f"{option} {shown}: cannot reach Redis ({exc})") from None
    except REDIS_ERRORS as exc:
        raise StartupError(f"{option} {shown}: Redis refused us ({exc})") from None
    finally:
        client.close()


def check_ports(host: str, ports: dict[str, int | None]) -> None:
    """Every port given by its option, and no two options on the same port."""
    given = {option: port for option, port in ports.items() if port is not None}
    seen: dict[int, str] = {}
    for option, port in given.items():
        if port in seen:
            raise StartupError(f"{option} {port}: already taken by {seen[port]}")
        seen[port] = option
        check_port(host, port, option)
