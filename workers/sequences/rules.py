"""The sequence batcher's rules, read from a model's `sequence_batching`."""

from __future__ import annotations

from typing import Any

from sluice.shared.model_config import ModelSpec
from sluice.workers.sequences.sequence_batcher import Rules


def sequence_rules(spec: ModelSpec) -> Rules:
    """Triton's defaults where the config is silent: `direct`, one candidate sequence per
    instance under `oldest`, an idle time of 1 s."""
    config: dict[str, Any] = spec.config.json.get("sequence_batching") or {}
    idle_us = int(config.get("max_sequence_idle_microseconds") or 1_000_000)
    max_batch_size = max(1, spec.max_batch_size)
    if "oldest" in config:
        oldest = config["oldest"] or {}
        return Rules(
            "oldest",
            spec.instance_count,
            slots=max(1, int(oldest.get("max_candidate_sequences") or 1)),
            max_batch_size=max_batch_size,
            idle_ns=idle_us * 1000,
            delay_ns=int(oldest.get("max_queue_delay_microseconds") or 0) * 1000,
            preferred_batch_sizes=frozenset(
                int(size) for size in oldest.get("preferred_batch_size") or ()
            ),
        )
    direct = config.get("direct") or {}
    return Rules(
        "direct",
        spec.instance_count,
        slots=max_batch_size,
        max_batch_size=max_batch_size,
        idle_ns=idle_us * 1000,
        delay_ns=int(direct.get("max_queue_delay_microseconds") or 0) * 1000,
        minimum_slot_utilization=float(direct.get("minimum_slot_utilization") or 0.0),
    )
