"""A load or unload, fleet-wide: declare it, then (a load) wait for the workers. The
repository API's (gateway/core.py) and a Python model's `pb_utils.load_model` /
`unload_model` (workers/python_backend/model_control.py) go the same way.

A load returns once one worker that serves the repository reports the model READY at the
load's generation, and fails with every worker's reason once all of them that could load it
reported failing (Triton's answer: 400 "load failed for model 'M': ..."). Heartbeats carry
each worker's state; a worker beats at once when a model changes state, so this looks at the
fleet's hash often rather than waiting for the next second.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from sluice.shared import keys
from sluice.shared.config_view import ConfigView
from sluice.shared.ensemble import collect_configs
from sluice.shared.errors import InvalidInput, SluiceError, Unavailable
from sluice.shared.redis_client import AsyncClient
from sluice.shared.registry import READY, Member, ModelRecord, live_members, now_ms
from sluice.shared.repository_control import (
    OverridesFull,
    declare,
    model_name_problem,
    override_path,
)

#: how often the fleet's states are looked at while a load is applied.
LOAD_POLL_S = 0.05


def failed_to_poll(name: str) -> SluiceError:
    """Triton's answer (INTERNAL, 500) to a load of a model no repository holds."""
    return SluiceError(f"failed to load '{name}', failed to poll from model repository")


def check_load(name: str, config_json: str | None, files: Mapping[str, bytes] | None) -> None:
    """A load's parameters as Triton takes them (InvalidInput naming the one that is wrong;
    Triton's INTERNAL "failed to load" for a config override that is no JSON object).
    The name is checked first, with or without files: workers make it a directory."""
    if (problem := model_name_problem(name)) is not None:
        raise InvalidInput(f"load failed for model '{name}': {problem}")
    if config_json is not None:
        # Triton reads the override with the repository: one that is no JSON object fails the poll
        try:
            config = json.loads(config_json)
        except ValueError:
            raise failed_to_poll(name) from None
        if not isinstance(config, dict):
            raise failed_to_poll(name)
    if files:
        if config_json is None:
            raise InvalidInput(
                f"load failed for model '{name}': parameter 'config' is required with "
                "'file:' parameters (they replace the model's directory)"
            )
        for parameter in files:
            try:
                override_path(parameter)
            except ValueError as exc:
                raise InvalidInput(f"load failed for model '{name}': parameter {exc}") from None


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """Where a load stands across the fleet: done (ready somewhere), failed, or pending."""

    ready: bool
    #: every worker that could load it failed, with these reasons (empty: not yet).
    reasons: list[str]


def load_outcome(name: str, generation: int, workers: list[Member], anywhere: bool) -> LoadOutcome:
    """The load's outcome from the workers' heartbeats; `anywhere`: every worker can load it
    (its files came with the load), else only those whose repository holds it."""
    candidates = [w for w in workers if anywhere or name in w.repository]
    applied = [
        status
        for worker in candidates
        if (status := worker.models.get(name)) is not None and status.generation >= generation
    ]
    if any(s.current_state == READY and not s.reason for s in applied):
        return LoadOutcome(True, [])
    if len(applied) < len(candidates):
        return LoadOutcome(False, [])  # still loading on some
    reasons = [s.reason or f"state {s.current_state}" for s in applied]
    if not candidates:
        reasons.append("no live worker serves the model's repository")
    return LoadOutcome(False, sorted(set(reasons)))


async def load_fleet_wide(
    redis: AsyncClient,
    name: str,
    config_json: str | None,
    files: Mapping[str, bytes] | None,
    timeout_s: float,
    max_file_models: int = 0,
) -> None:
    """Declare the load, then wait until the fleet has applied it (see the module's doc)."""
    try:
        generation = await declare(
            redis,
            name,
            loaded=True,
            config_json=config_json,
            files=files,
            max_file_models=max_file_models,
        )
    except OverridesFull:
        raise InvalidInput(
            f"load failed for model '{name}': the fleet holds the 'file:' overrides of "
            f"{max_file_models} models already (--max-override-models); unload one first"
        ) from None
    deadline_s = time.monotonic() + timeout_s
    while True:
        outcome = load_outcome(name, generation, await live_workers(redis), bool(files))
        if outcome.ready:
            return
        if outcome.reasons:
            raise InvalidInput(f"load failed for model '{name}': {'; '.join(outcome.reasons)}")
        if time.monotonic() >= deadline_s:
            raise Unavailable(
                f"load of model '{name}' not finished within {timeout_s:g}s; it goes on, see "
                "POST /v2/repository/index"
            )
        await asyncio.sleep(LOAD_POLL_S)


#: a model's config and whether the fleet serves it, as whoever loads it sees them now.
Look = Callable[[str], Awaitable[tuple[ConfigView | None, bool]]]


async def load_composing(
    redis: AsyncClient, name: str, look: Look, timeout_s: float, max_file_models: int = 0
) -> None:
    """After loading `name`: if it is an ensemble, load its composing models not ready yet
    (nested ones' too), as Triton loads an ensemble's steps with it."""
    steps, seen = _steps((await look(name))[0]), {name}
    while steps:
        step = steps.pop(0)
        if step in seen:
            continue
        seen.add(step)
        config, ready = await look(step)
        if not ready:
            await load_fleet_wide(redis, step, None, None, timeout_s, max_file_models)
            config, _ = await look(step)
        steps += _steps(config)


def _steps(config: ConfigView | None) -> list[str]:
    return list(config.ensemble_steps) if config is not None else []


async def fleet_look(redis: AsyncClient, name: str) -> tuple[ConfigView | None, bool]:
    """A model's config as its workers announced it, and whether one of them has it ready."""
    raw = await redis.hget(keys.MODELS, name)
    config = ModelRecord.decode(cast("bytes", raw)).config if raw is not None else None
    ready = any(
        (status := w.models.get(name)) is not None and status.ready_versions
        for w in await live_workers(redis)
    )
    return config, ready


async def live_workers(redis: AsyncClient) -> list[Member]:
    """The workers whose heartbeats are current."""
    fleet = await redis.hgetall(keys.FLEET)
    members, _ = live_members(cast("dict[bytes, bytes]", fleet), now_ms())
    return [m for m in members if m.kind == "worker"]


async def load_checked(
    redis: AsyncClient,
    name: str,
    config_json: str | None,
    files: Mapping[str, bytes] | None,
    timeout_s: float,
) -> None:
    """A load with the checks the gateway makes against its model table, made against the
    workers' heartbeats instead: Triton's "failed to poll" for a model no repository holds."""
    check_load(name, config_json, files)
    if not files and not any(name in w.repository for w in await live_workers(redis)):
        raise failed_to_poll(name)
    await load_fleet_wide(redis, name, config_json, files, timeout_s)
    await load_composing(redis, name, lambda model: fleet_look(redis, model), timeout_s)


async def unload_fleet_wide(
    redis: AsyncClient,
    name: str,
    unload_dependents: bool,
    config_of: Callable[[str], ConfigView | None],
) -> list[str]:
    """Declare the unload of `name` and, with `unload_dependents`, of the models its ensemble
    names (nested ones' too, looked up with `config_of`); the models declared unloaded."""
    names = [name]
    if unload_dependents:
        names += [m for m in collect_configs(name, lambda m: _json(config_of(m))) if m != name]
    for model in names:
        await declare(redis, model, loaded=False)
    return names


def _json(config: ConfigView | None) -> Mapping[str, Any] | None:
    """The config as JSON, which an ensemble's steps are collected from."""
    return config.json if config is not None else None


async def unload_checked(redis: AsyncClient, name: str, unload_dependents: bool) -> None:
    """`unload_fleet_wide` with the configs the workers announced; a model that no worker's
    repository holds and none announced is left alone, as Triton answers such an unload."""
    records = cast("dict[bytes, bytes]", await redis.hgetall(keys.MODELS))
    configs = {
        model.decode(): config
        for model, raw in records.items()
        if (config := ModelRecord.decode(raw).config) is not None
    }
    known = set(configs) | {m for w in await live_workers(redis) for m in w.repository}
    if name in known:
        await unload_fleet_wide(redis, name, unload_dependents, configs.get)
