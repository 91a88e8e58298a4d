"""Model repository control: the fleet's desired state of each model, kept in Redis.

A load or unload through any gateway is recorded as the model's desired state (a generation
from one counter, loaded or not, the config override) in one hash, with the `file:` overrides
beside it, and a pub/sub nudge; every worker that serves the repository applies it at once,
and a worker that starts later or missed the nudge applies it on its next heartbeat. Workers
report the generation they applied in their heartbeats, which is how a gateway knows a load
has finished fleet-wide. All keys share the `{sluice}` hash tag, so the scripts that write
them run on one Redis Cluster node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal

import msgpack
from sluice.shared import keys
from sluice.shared.lua import Lua
from sluice.shared.redis_client import AsyncClient

ControlMode = Literal["none", "poll", "explicit"]
#: `--load-model *`: every model of the repository.
ALL_MODELS = "*"

#: Triton's answer to a load or unload outside explicit mode (HTTP 503).
NOT_EXPLICIT = "explicit model load / unload is not allowed if polling is enabled"

#: hand out the next generation, record the desired state (and its files), nudge the workers;
#: -1 (nothing written) for the files of one model more than ARGV[6] allows (0: no limit).
DECLARE = Lua(
    """
if ARGV[4] ~= '' and tonumber(ARGV[6]) > 0 and redis.call('HEXISTS', KEYS[3], ARGV[1]) == 0
    and redis.call('HLEN', KEYS[3]) >= tonumber(ARGV[6]) then
  return -1
end
local generation = redis.call('INCR', KEYS[1])
local record = cmsgpack.pack({generation, ARGV[2] == '1', ARGV[3], ARGV[4] ~= ''})
redis.call('HSET', KEYS[2], ARGV[1], record)
if ARGV[4] == '' then
  redis.call('HDEL', KEYS[3], ARGV[1])
else
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
end
redis.call('PUBLISH', ARGV[5], ARGV[1])
return generation
"""
)


#: a worker's model record (its config, for the gateways), unless the desired state is of a
#: newer load than the worker applied: a worker yet to see a load must not put back the config
#: that load replaced, which gateways would then serve until its next heartbeat.
ANNOUNCE = Lua(
    """
local wanted = redis.call('HGET', KEYS[2], ARGV[1])
if wanted and cmsgpack.unpack(wanted)[1] > tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""
)


def announce_command(model: str, generation: int, record: bytes) -> tuple[Any, ...]:
    """The command that publishes `record` as the model's, as of desired `generation`."""
    return ANNOUNCE.command([keys.MODELS, keys.DESIRED], [model, generation, record])


@dataclass(frozen=True, slots=True)
class DesiredModel:
    """What the fleet should serve of one model, as the last load or unload said."""

    generation: int
    loaded: bool
    #: the load's `config` parameter (model config JSON), None: the repository's config.pbtxt.
    config_json: str | None = None
    #: the load came with `file:` overrides (kept apart, see read_files).
    has_files: bool = False

    @property
    def overridden(self) -> bool:
        return self.config_json is not None


def load_model_problem(mode: str, names: tuple[str, ...]) -> str | None:
    """What is wrong with `--load-model` under `--model-control-mode` (Triton's texts)."""
    if names and mode != "explicit":
        return "use of '--load-model' requires setting '--model-control-mode=explicit' as well"
    if ALL_MODELS in names and len(names) > 1:
        return "wildcard model name '*' must be the ONLY startup model if specified at all"
    return None


#: the longest model name: one directory name on the workers' filesystems (255 bytes).
MAX_MODEL_NAME_BYTES = 255


def model_name_problem(name: str) -> str | None:
    """Why `name` cannot name a model directory (None: it can). A model is one directory of
    the repository, so its name is one path component: never empty, `.` or `..`, and with no
    separator or NUL, so that no name from the wire or from Redis reaches another directory."""
    if name in ("", ".", ".."):
        return f"model name '{name}' is not a directory name"
    if any(c in name for c in "/\\\0"):
        return "model name must not contain '/', '\\' or NUL"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_MODEL_NAME_BYTES:
        return f"model name is longer than {MAX_MODEL_NAME_BYTES} bytes"
    return None


def override_path(parameter: str) -> PurePosixPath:
    """`file:1/model.pt` -> `1/model.pt`; ValueError for a path that leaves the model dir."""
    path = PurePosixPath(parameter.removeprefix("file:"))
    if not path.parts or path.is_absolute() or ".." in path.parts or str(path) == ".":
        raise ValueError(f"'{parameter}' must name a file inside the model directory")
    return path


class OverridesFull(Exception):
    """The fleet holds the `file:` overrides of as many models as it may (nothing written)."""


async def declare(
    redis: AsyncClient,
    model: str,
    *,
    loaded: bool,
    config_json: str | None = None,
    files: Mapping[str, bytes] | None = None,
    max_file_models: int = 0,
) -> int:
    """Record a load (`loaded`) or an unload of `model` for the whole fleet; its generation.
    The files of at most `max_file_models` models are kept (0: no limit), as Redis holds
    them until their model is unloaded: one more is OverridesFull."""
    packed_files = msgpack.packb(dict(files)) if files else b""
    args = [
        model,
        "1" if loaded else "0",
        config_json or "",
        packed_files,
        keys.DESIRED_CHANNEL,
        max_file_models,
    ]
    reply = int(
        await DECLARE.run(redis, [keys.DESIRED_GENERATION, keys.DESIRED, keys.DESIRED_FILES], args)
    )
    if reply < 0:
        raise OverridesFull(model)
    return reply


def decode_desired(raw: bytes | str) -> DesiredModel:
    blob = raw.encode() if isinstance(raw, str) else raw
    generation, loaded, config, has_files = msgpack.unpackb(blob)
    text = config.decode() if isinstance(config, bytes) else config
    return DesiredModel(int(generation), bool(loaded), text or None, bool(has_files))


def decode_all(raw: Mapping[Any, Any]) -> dict[str, DesiredModel]:
    """HGETALL of the desired hash as model name -> desired state."""
    return {
        (name.decode() if isinstance(name, bytes) else name): decode_desired(blob)
        for name, blob in raw.items()
    }


async def read_desired(redis: AsyncClient) -> dict[str, DesiredModel]:
    return decode_all(await redis.hgetall(keys.DESIRED))


async def read_files(redis: AsyncClient, model: str) -> dict[str, bytes]:
    """The `file:` overrides of the model's last load (empty: none)."""
    raw = await redis.hget(keys.DESIRED_FILES, model)
    if not raw:
        return {}
    files: dict[Any, bytes] = msgpack.unpackb(raw.encode() if isinstance(raw, str) else raw)
    return {(k.decode() if isinstance(k, bytes) else k): v for k, v in files.items()}
