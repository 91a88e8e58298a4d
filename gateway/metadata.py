"""Server and model metadata, config and statistics bodies, shaped as Triton returns them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from sluice.gateway.model_table import ModelView
from sluice.shared.registry import READY
from sluice.shared.stats import (
    VersionStats,
    models_stats,
    parse_stats,
    read_stats_commands,
    triton_model_stats,
)

from sluice import __version__

# A Triton client sees the Triton release whose protocol sluice answers (NVIDIA's examples check the
# name); sluice names itself, with its own version, among the extensions.
SERVER_NAME = "triton"
SERVER_VERSION = "2.51.0"
EXTENSIONS = (
    "binary_tensor_data",
    "model_configuration",
    "statistics",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "parameters",
    "system_shared_memory",
    "cuda_shared_memory",
    "trace",
    "logging",
    f"sluice/{__version__}",
)


def server_metadata() -> dict[str, Any]:
    return {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": list(EXTENSIONS)}


def model_metadata(view: ModelView, version: int | None) -> dict[str, Any]:
    sig = view.signature
    assert sig is not None and view.config is not None
    versions = [str(version)] if version else [str(v) for v in sorted(view.versions)]
    platform = view.config.platform or view.config.backend
    return {
        "name": view.name,
        "versions": versions,
        "platform": platform,
        "inputs": [
            {"name": i.name, "datatype": i.datatype, "shape": sig.full_shape(i)} for i in sig.inputs
        ],
        "outputs": [
            {"name": o.name, "datatype": o.datatype, "shape": sig.full_shape(o)}
            for o in sig.outputs
        ],
    }


def repository_index(
    models: dict[str, ModelView], repository: Iterable[str], ready_only: bool = False
) -> list[dict[str, Any]]:
    """Triton's index: a model of some worker's repository never loaded is its name alone;
    others one entry per version, with its state and (when not empty) the reason."""
    index: list[dict[str, Any]] = []
    for name in sorted(set(models) | set(repository)):
        view = models.get(name)
        if view is None:
            if not ready_only:
                index.append({"name": name})
            continue
        versions: list[int | None] = [*sorted(view.versions)] or [None]
        for version in versions:
            ready = version in view.ready_versions
            if ready_only and not ready:
                continue
            entry = {
                "name": view.name,
                "version": str(version) if version is not None else "",
                "state": READY if ready else view.state,
            }
            reason = "" if ready else (view.reason or "")
            if reason:
                entry["reason"] = reason
            index.append(entry)
    return index


async def model_statistics(
    redis: aioredis.Redis, views: list[ModelView], version: int | None
) -> dict[str, Any]:
    """Triton's statistics body, fleet-wide, from the stats hashes the workers keep."""
    models = [(view.name, view.partitions) for view in views]
    async with redis.pipeline(transaction=False) as pipe:
        for command in read_stats_commands(models):
            pipe.execute_command(*command)
        replies = await pipe.execute()
        entries = []
        for view, raw in zip(views, models_stats(replies, models), strict=True):
            per_version = parse_stats(raw)
            wanted = [version] if version else sorted(set(view.versions) | set(per_version))
            for v in wanted:
                entries.append(
                    triton_model_stats(view.name, v, per_version.get(v) or VersionStats())
                )
        return {"model_stats": entries}
