"""Secrets given apart from the command line, whose arguments any local user sees in `ps`:
read from a file (--auth-token-file, --redis-password-file) or taken from the environment."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from sluice.options import SettingsError


def read_secret(path: Path, flag: str) -> str:
    """The secret a file holds, without the line end editors and `kubectl create secret` add;
    an unreadable or empty file is an error naming `flag`."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SettingsError(flag, f"{flag} {path}: cannot read it ({reason})") from None
    secret = text.rstrip("\r\n")
    if not secret:
        raise SettingsError(flag, f"{flag} {path}: the file is empty")
    return secret


def one_secret(value: str | None, file: Path | None, flag: str, file_flag: str) -> str | None:
    """The secret given either directly (`flag` or its variable) or in a file, not both."""
    if file is None:
        return value
    if value is not None:
        raise SettingsError(file_flag, f"{file_flag}: give it or {flag}, not both")
    return read_secret(file, file_flag)


def with_password(url: str, password: str) -> str:
    """A Redis URL with `password` in its userinfo (any user name it has kept)."""
    parts = urlsplit(url)
    userinfo, _, address = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{address}"))
