"""A click command's options made from a settings class, collected into one settings object.

Where a value comes from, first found wins: the option on the command line (its current
spelling, then its former one), the settings a parent process handed down in one environment
variable (how `sluice serve` configures the workers it starts), the option's environment
variable (current, then former), the field's default.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import orjson
from click.core import ParameterSource

from sluice.options import (
    OPTION,
    Option,
    S,
    SettingsError,
    base_type,
    choices,
    env_of,
    flag_of,
    old_env_of,
    option_fields,
)
from sluice.preflight import StartupError

OLD = "{}__old"
PLAIN_TYPES: dict[Any, Any] = {int: int, float: float, str: str, Path: click.Path(path_type=Path)}


def settings_command(
    cls: type[S], handed_down: str | None = None
) -> Callable[[Callable[[S], None]], Callable[..., None]]:
    """Give the decorated `run(settings)` one click option per field of `cls`.

    `handed_down` names an environment variable that may hold the settings as JSON (see
    `Settings.to_json_dict`), written by the process that started this one.
    """

    def decorate(run: Callable[[S], None]) -> Callable[..., None]:
        @functools.wraps(run)
        def command(**values: Any) -> None:
            run(collect(cls, click.get_current_context(), values, handed_down))

        hints = typing.get_type_hints(cls)
        for field in reversed(_help_order(cls)):  # click lists the last decorator first
            for param in _options(field, hints[field.name]):
                command = param(command)
        return command

    return decorate


def _help_order(cls: type[S]) -> list[dataclasses.Field[Any]]:
    """The role's own options first, those it shares with other roles after."""
    fields = option_fields(cls)
    declared_by = [set(vars(k).get("__annotations__", {})) for k in cls.__mro__]
    return sorted(fields, key=lambda f: next(i for i, d in enumerate(declared_by) if f.name in d))


def _click_type(field: dataclasses.Field[Any], hint: Any) -> Any:
    spec: Option = field.metadata[OPTION]
    allowed = choices(hint)
    if spec.parse is not None:
        return str
    if allowed is not None:
        return click.Choice([str(a) for a in allowed])
    kind = base_type(hint)
    return PLAIN_TYPES.get(kind, kind)


def _options(field: dataclasses.Field[Any], hint: Any) -> list[Callable[[Any], Any]]:
    """The field's option, and its former spelling hidden from --help."""
    spec: Option = field.metadata[OPTION]
    declared = spec.flag or flag_of(field)
    kwargs: dict[str, Any]
    if base_type(hint) is bool:  # `--a/--b` pairs are flags by their name alone
        kwargs = {} if "/" in declared else {"is_flag": True}
    elif spec.repeat:  # a tuple of strings, one per use of the option
        kwargs = {"type": str, "multiple": True}
    else:
        kwargs = {"type": _click_type(field, hint)}
    default = None if field.default is dataclasses.MISSING else field.default
    params = [
        click.option(
            declared,
            field.name,
            default=default,
            envvar=env_of(field),
            show_envvar=True,
            show_default=default is not None,
            help=spec.help,
            **kwargs,
        )
    ]
    if spec.old is not None:
        old_name, old_env = OLD.format(field.name), old_env_of(spec)
        params.append(click.option(spec.old, old_name, envvar=old_env, hidden=True, **kwargs))
    return params


def collect(cls: type[S], ctx: click.Context, values: dict[str, Any], handed_down: str | None) -> S:
    """The settings from parsed option values; a mistake exits with one line naming it."""
    handed = _handed_down(handed_down)
    unknown = set(handed) - {f.name for f in option_fields(cls)}
    if unknown:
        raise StartupError(f"{handed_down}: unknown settings {', '.join(sorted(unknown))}")
    kwargs: dict[str, Any] = {}
    for field in option_fields(cls):
        value = _pick(cls, ctx, values, handed, field.name)
        if value is None and field.default is dataclasses.MISSING:
            raise click.UsageError(f"Missing option '{flag_of(field)}'.", ctx)
        spec: Option = field.metadata[OPTION]
        if spec.parse is not None and isinstance(value, str):
            value = _parse(field, spec, value)
        kwargs[field.name] = value
    try:
        return cls(**kwargs)
    except SettingsError as exc:
        raise StartupError(str(exc)) from None


def _pick(
    cls: type[S], ctx: click.Context, values: dict[str, Any], handed: dict[str, Any], name: str
) -> Any:
    old = OLD.format(name)

    def given(param: str, source: ParameterSource) -> bool:
        return ctx.get_parameter_source(param) is source and values.get(param) is not None

    for param in (name, old):
        if given(param, ParameterSource.COMMANDLINE):
            return values[param]
    if name in handed:
        return cls.revive(name, handed[name])
    if given(old, ParameterSource.ENVIRONMENT) and not given(name, ParameterSource.ENVIRONMENT):
        return values[old]
    return values.get(name)


def _parse(field: dataclasses.Field[Any], spec: Option, text: str) -> Any:
    assert spec.parse is not None
    try:
        return spec.parse(text)
    except ValueError as exc:
        raise StartupError(f"{flag_of(field)} {text}: {exc}") from None


def _handed_down(variable: str | None) -> dict[str, Any]:
    text = os.environ.get(variable) if variable else None
    if not text:
        return {}
    try:
        handed = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise StartupError(f"{variable}: not JSON ({exc})") from None
    if not isinstance(handed, dict):
        raise StartupError(f"{variable}: not a JSON object")
    return handed
