"""Settings whose fields are the command-line options: each option is written once.

A role's settings (gateway, worker, serve, bench) is a frozen dataclass; each field declared
with `option()` is one command-line option, whose name (`--field-name`), environment variable
(`SLUICE_FIELD_NAME`), type (the annotation), default, help and check all come from the field.
`Settings.__post_init__` checks every field, so settings built in code are held to the same
rules as those parsed from a command line, and an error names the option to fix. A former
spelling of an option stays as a hidden alias (see sluice.options_cli).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

#: the key of a field's `Option` in its dataclass metadata.
OPTION = "sluice.option"
ENV_PREFIX = "SLUICE_"

S = TypeVar("S", bound="Settings")
#: a check returns what is wrong with a value, or None when it is fine.
Check = Callable[[Any], "str | None"]


@dataclass(frozen=True, slots=True)
class Option:
    """How one settings field is written on the command line and in the environment."""

    help: str
    #: the flag when it is not `--field-name` (e.g. `--binary/--json` for a boolean pair).
    flag: str | None = None
    #: the environment variable when it is not `SLUICE_FIELD_NAME`.
    env: str | None = None
    #: a former flag, still accepted (with its `SLUICE_` variable) but hidden from --help.
    old: str | None = None
    check: Check | None = None
    #: command-line text -> the field's value, for types click does not convert itself.
    parse: Callable[[str], Any] | None = None
    #: how a value is quoted in error messages (a URL without its password).
    shown: Callable[[Any], str] = str
    #: the option may be given several times (a tuple field: one value each time).
    repeat: bool = False


def option(
    default: Any = MISSING,
    *,
    help: str,
    flag: str | None = None,
    env: str | None = None,
    old: str | None = None,
    check: Check | None = None,
    parse: Callable[[str], Any] | None = None,
    shown: Callable[[Any], str] = str,
    repeat: bool = False,
) -> Any:
    """A settings field that is also a command-line option (no default: required)."""
    spec = Option(help, flag, env, old, check, parse, shown, repeat)
    return dataclasses.field(default=default, metadata={OPTION: spec})


def flag_of(field: dataclasses.Field[Any]) -> str:
    spec: Option = field.metadata[OPTION]
    return (spec.flag or "--" + field.name.replace("_", "-")).split("/")[0]


def env_of(field: dataclasses.Field[Any]) -> str:
    spec: Option = field.metadata[OPTION]
    return spec.env or ENV_PREFIX + field.name.upper()


def old_env_of(spec: Option) -> str | None:
    if spec.old is None:
        return None
    return ENV_PREFIX + spec.old.lstrip("-").replace("-", "_").upper()


def option_fields(cls: type[Settings]) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if OPTION in f.metadata]


def at_least(low: float) -> Check:
    return lambda value: None if value >= low else f"must be at least {low:g}"


def positive(value: float) -> str | None:
    return None if value > 0 else "must be above 0"


def port(value: int) -> str | None:
    return None if 1 <= value <= 65535 else "must be a port number, 1 to 65535"


class SettingsError(ValueError):
    """A value an option does not take; the message starts with the option's flag."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def choices(hint: Any) -> tuple[Any, ...] | None:
    """The values a `Literal[...]` (or `Literal[...] | None`) annotation allows."""
    if get_origin(hint) is Literal:
        return get_args(hint)
    literal = [a for a in get_args(hint) if get_origin(a) is Literal]
    return get_args(literal[0]) if literal else None


def optional(hint: Any) -> bool:
    """Whether an annotation allows None (`int | None`)."""
    return get_origin(hint) in (Union, UnionType) and NoneType in get_args(hint)


def base_type(hint: Any) -> Any:
    """`int | None` -> int; `tuple[int, ...]` -> tuple; `Literal[...]` -> str."""
    if choices(hint) is not None:
        return str
    if optional(hint):
        hint = next(a for a in get_args(hint) if a is not NoneType)
    return get_origin(hint) or hint


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Base of every role's settings: each option field is checked once built."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for field in option_fields(type(self)):
            value, flag = getattr(self, field.name), flag_of(field)
            if value is None:
                if not optional(hints[field.name]):
                    raise SettingsError(flag, f"{flag}: required")
                continue
            spec: Option = field.metadata[OPTION]
            allowed = choices(hints[field.name])
            if allowed is not None and value not in allowed:
                problem: str | None = "must be one of " + ", ".join(map(str, allowed))
            else:
                problem = spec.check(value) if spec.check else None
            if problem:
                raise SettingsError(flag, f"{flag} {spec.shown(value)}: {problem}")

    def to_json_dict(self) -> dict[str, Any]:
        """The options' values as JSON types, to hand these settings to a child process."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in option_fields(type(self))}

    @classmethod
    def revive(cls, name: str, value: Any) -> Any:
        """A value of `to_json_dict` back as the field's type."""
        kind = base_type(typing.get_type_hints(cls)[name])
        if value is None or kind not in (Path, tuple):
            return value
        return kind(value)
