"""The fleet at a glance: live workers and gateways, and each model's queue.

Read-only and cheap enough to poll every second: one pipeline for the fleet-wide hashes,
then one pipeline per model (its keys share one hash tag, so each pipeline stays in one
Redis Cluster slot), the models' pipelines sent concurrently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from redis.exceptions import ResponseError
from sluice.shared import keys
from sluice.shared.queue_policy import QueuePolicy
from sluice.shared.redis_client import AsyncClient
from sluice.shared.registry import Member, ModelRecord, live_members, now_ms


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entry_ms(entry_id: bytes | str) -> int:
    """Stream ids are `<ms>-<seq>`: the ms part is when the entry was added."""
    return int(_text(entry_id).split("-", 1)[0])


def _or_missing(value: Any, missing: Any) -> Any:
    """A command on a stream that does not exist yet means an empty queue, not a failure."""
    if isinstance(value, ResponseError):
        if "no such key" in str(value).lower():
            return missing
        raise value
    if isinstance(value, Exception):
        raise value
    return value


def member_json(member: Member, at_ms: int) -> dict[str, Any]:
    """A member as JSON: identity, heartbeat age, models, and what its heartbeat reports."""
    info = dict(member.info)
    instances: Mapping[str, int] = info.pop("instances", {}) or {}
    models = {
        name: {
            "ready_versions": sorted(status.ready_versions),
            "instances": int(instances.get(name, 0)),
            "error": status.reason,
        }
        for name, status in sorted(member.models.items())
    }
    return {
        "id": member.id,
        "kind": member.kind,
        "host": member.host,
        "pid": member.pid,
        "heartbeat_age_ms": max(0, at_ms - member.heartbeat_ms),
        "models": models,
        **info,
    }


async def _model_queue(
    redis: AsyncClient, model: str, levels: tuple[int, ...], partitions: int, at_ms: int
) -> dict[str, Any]:
    """Depth, group lag and pending, oldest entry age and dead letters of one model (over
    its partitions: shared/partitions.py)."""
    streams = [keys.request_stream(model, lv, p) for p in range(partitions) for lv in levels]
    async with redis.pipeline(transaction=False) as pipe:
        for stream in streams:
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
            pipe.xrange(stream, count=1)
        pipe.xlen(keys.dead_letters(model))
        replies = await pipe.execute(raise_on_error=False)
    depth = pending = 0
    lag: int | None = 0
    oldest_ms: int | None = None
    for i in range(len(streams)):
        length, groups, first = replies[3 * i : 3 * i + 3]
        length = int(_or_missing(length, 0))
        depth += length
        group = next(
            (g for g in _or_missing(groups, []) if _text(g["name"]) == keys.WORKER_GROUP), None
        )
        # no group yet: no worker ever read the stream, so every entry is undelivered
        group_lag = length if group is None else group.get("lag")
        lag = None if lag is None or group_lag is None else lag + int(group_lag)
        if group is not None:
            pending += int(group.get("pending") or 0)
        first = _or_missing(first, [])
        if first:
            added_ms = _entry_ms(first[0][0])
            oldest_ms = added_ms if oldest_ms is None else min(oldest_ms, added_ms)
    return {
        "queue_depth": depth,
        "lag": lag,
        "pending": pending,
        "oldest_waiting_ms": None if oldest_ms is None else max(0, at_ms - oldest_ms),
        "dead_letters": int(_or_missing(replies[-1], 0)),
    }


async def fleet_status(redis: AsyncClient) -> dict[str, Any]:
    """Every live member and every known model's queue, as JSON-able data.

    `members` holds only members with a fresh heartbeat, so a crashed one drops out within
    MEMBER_TTL_S. Queue depth counts stream entries (a gateway may pack several requests into
    one); `lag` is None when Redis cannot tell (before 7.0, or after deletions).
    """
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.FLEET)
        pipe.hgetall(keys.MODELS)
        fleet_raw, models_raw = await pipe.execute()
    at_ms = now_ms()
    members, _ = live_members(fleet_raw, at_ms)
    members.sort(key=lambda m: (m.kind != "worker", m.id))
    records = {_text(name): ModelRecord.decode(blob) for name, blob in models_raw.items()}
    served: dict[str, list[str]] = {}
    states: dict[str, dict[str, int]] = {}
    for member in members:
        if member.kind != "worker":
            continue
        for name, status in member.models.items():
            records.setdefault(name, ModelRecord(None, [], status.reason))
            if status.ready_versions:
                served.setdefault(name, []).append(member.id)
            counts = states.setdefault(name, {})
            counts[status.current_state] = counts.get(status.current_state, 0) + 1
    names = sorted(records)
    configs = [records[n].config for n in names]
    queues = await asyncio.gather(
        *(
            _model_queue(
                redis,
                n,
                (c.queue_policy if c else QueuePolicy()).levels,
                c.partitions if c else 1,
                at_ms,
            )
            for n, c in zip(names, configs, strict=True)
        )
    )
    models = {
        name: {
            **queue,
            "versions": list(records[name].versions),
            "error": None if name in served else records[name].error,
            "workers": served.get(name, []),
            #: how many live workers hold the model in each state (READY, LOADING, ...).
            "states": dict(sorted(states.get(name, {}).items())),
        }
        for name, queue in zip(names, queues, strict=True)
    }
    return {"members": [member_json(m, at_ms) for m in members], "models": models}
