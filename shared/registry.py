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
from sluice.shared.config_view import ConfigView

HEARTBEAT_INTERVAL_S = 1.0
#: a member whose heartbeat is older than this is gone.
MEMBER_TTL_S = 5.0
#: a worker's info key: model -> [running, waiting] sequences of its generative models.
SEQUENCES = "sequences"


#: a model's states on a worker, as Triton's repository index names them.
READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"


@dataclass(slots=True)
class ModelStatus:
    ready_versions: list[int] = field(default_factory=list)
    #: why the model (or some version) is unavailable on this member; with state READY, why
    #: the last load of it failed (the versions loaded before still serve).
    reason: str | None = None
    #: READY, LOADING, UNLOADING or UNAVAILABLE (None: READY when versions are ready).
    state: str | None = None
    #: the generation of the fleet's desired state this member applied to the model (0: none).
    generation: int = 0

    @property
    def current_state(self) -> str:
        if self.state is not None:
            return self.state
        return READY if self.ready_versions else UNAVAILABLE

    def encode(self) -> list[Any]:
        return [self.ready_versions, self.reason, self.state, self.generation]

    @classmethod
    def decode(cls, fields: list[Any]) -> ModelStatus:
        """Also a heartbeat from before states and generations: `[versions, reason]`."""
        versions, reason, *rest = fields
        state = rest[0] if rest else None
        generation = rest[1] if len(rest) > 1 else 0
        return cls(list(versions), reason, state, int(generation))


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
    #: the models in this worker's repository that it would serve (loaded or not).
    repository: list[str] = field(default_factory=list)

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "id": self.id,
                "kind": self.kind,
                "host": self.host,
                "pid": self.pid,
                "hb": self.heartbeat_ms,
                "models": {m: s.encode() for m, s in self.models.items()},
                "info": self.info,
                "repo": self.repository,
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
            {m: ModelStatus.decode(fields) for m, fields in d["models"].items()},
            d.get("info", {}),
            list(d.get("repo", [])),
        )


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def encode_model_record(
    config_json: Mapping[str, Any] | None, versions: list[int], error: str | None
) -> bytes:
    return msgpack.packb({"config": config_json, "versions": versions, "error": error})


@dataclass(frozen=True, slots=True)
class ModelRecord:
    """A model as its workers announced it, its config parsed once for all who read it."""

    #: None: no worker could load it (`error` says why).
    config: ConfigView | None
    versions: list[int]
    error: str | None

    @classmethod
    def decode(cls, raw: bytes) -> ModelRecord:
        record: dict[str, Any] = msgpack.unpackb(raw)
        config = record["config"]
        view = ConfigView.from_json(config) if config else None
        return cls(view, list(record["versions"]), record["error"])


def live_members(raw: Mapping[bytes, bytes], now_ms: int) -> tuple[list[Member], list[bytes]]:
    """Members with a fresh heartbeat, and the ids of stale ones to delete."""
    live, stale = [], []
    for member_id, blob in raw.items():
        try:
            member = Member.decode(blob)
        except (ValueError, KeyError, TypeError):
            stale.append(member_id)
            continue
        if now_ms - member.heartbeat_ms > MEMBER_TTL_S * 1000:
            stale.append(member_id)
        else:
            live.append(member)
    return live, stale
