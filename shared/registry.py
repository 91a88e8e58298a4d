"""Who serves what: model records and fleet heartbeats kept in Redis.

Workers publish each model they load (its Triton-style config) and a heartbeat that says
which versions are ready or why a model failed to load. Gateways read both to answer
metadata, readiness and routing without access to the model repository.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

HEARTBEAT_INTERVAL_S = 1.0
#: a member whose heartbeat is older than this is gone.
MEMBER_TTL_S = 5.0


@dataclass(slots=True)
class ModelStatus:
    ready_versions: list[int] = field(default_factory=list)
    #: why the model (or some version) is unavailable on this member.
    reason: str | None = None


@dataclass(slots=True)
class Member:
    """One worker or gateway as its heartbeat describes it."""

    id: str
    kind: str  # "worker" | "gateway"
    host: str
    pid: int
    heartbeat_ms: int
    models: dict[str, ModelStatus] = field(default_factory=dict)
    #: free-form figures (in-flight requests, device, batches done...).
    info: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "id": self.id,
                "kind": self.kind,
                "host": self.host,
                "pid": self.pid,
                "hb": self.heartbeat_ms,
                "models": {m: [s.ready_versions, s.reason] for m, s in self.models.items()},
                "info": self.info,
            }
        )

    @classmethod
    def decode(cls, raw: bytes) -> Member:
        d = msgpack.unpackb(raw)
        return cls(
            d["id"],
            d["kind"],
            d["host"],
            d["pid"],
            d["hb"],
            {m: ModelStatus(list(v), r) for m, (v, r) in d["models"].items()},
            d.get("info", {}),
        )


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def encode_model_record(
    config_json: Mapping[str, Any] | None, versions: list[int], error: str | None
) -> bytes:
    return msgpack.packb({"config": config_json, "versions": versions, "error": error})


def decode_model_record(raw: bytes) -> dict[str, Any]:
    record: dict[str, Any] = msgpack.unpackb(raw)
    return record


def live_members(raw: Mapping[bytes, bytes], now: int) -> tuple[list[Member], list[bytes]]:
    """Members with a fresh heartbeat, and the ids of stale ones to delete."""
    live, stale = [], []
    for member_id, blob in raw.items():
        try:
            member = Member.decode(blob)
        except (ValueError, KeyError, TypeError):
            stale.append(member_id)
            continue
        if now - member.heartbeat_ms > MEMBER_TTL_S * 1000:
            stale.append(member_id)
        else:
            live.append(member)
    return live, stale
