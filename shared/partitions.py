"""Partitions: one hot model's request streams split over several hash tags.

A model's keys share one hash tag, so a Redis Cluster keeps them on one shard, and one hot
model can use no more than that shard's CPU. With the config parameter
`parameters { key: "PARTITIONS" value: { string_value: "4" } }` its streams are split in four:
partition 0 keeps the model's own tag, partition p one of its own (keys.py), so the cluster
spreads them over its shards. Gateways deal stream entries out to the partitions in turn,
passing over one that has fallen more than a batch behind the others (a slow shard);
every worker of the model keeps a blocking read open on each partition, each for its share of
the room, so no partition starves and a batch may hold requests of several. Batching rules
(max_batch_size, the delay from each request's enqueue time), priority levels, reclaim and
dead letters are per model as before. Each partition keeps its own queue-size counter, which
admits its share of max_queue_size, and its own statistics, summed when they are read.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

#: the config parameter that splits a model's streams (absent: 1, one stream per level).
PARAMETER = "PARTITIONS"
#: more partitions than shards only adds reads; a cluster's shards stay well under this.
MAX_PARTITIONS = 64


def parse_partitions(value: str | None) -> int:
    """The parameter's value as a partition count; ValueError says what is wrong with it."""
    if value is None:
        return 1
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"must be an integer, got '{value}'") from None
    if not 1 <= count <= MAX_PARTITIONS:
        raise ValueError(f"must be between 1 and {MAX_PARTITIONS}, got {count}")
    return count


def config_partitions(config: Mapping[str, Any] | None) -> int:
    """The partition count of a model from its config as JSON (validated when it loaded)."""
    parameter = ((config or {}).get("parameters") or {}).get(PARAMETER) or {}
    return parse_partitions(parameter.get("string_value"))


def share(limit: int, partitions: int) -> int:
    """One partition's share of a model-wide limit (0: unbounded stays unbounded)."""
    return -(-limit // partitions) if limit else 0


class Dealer:
    """Deals a model's stream entries out to its partitions in turn, per model and level,
    passing over a partition that holds more than a batch beyond the shallowest (a slow
    shard), as last observed (`observe`: gateways look every heartbeat)."""

    def __init__(self) -> None:
        self._turns: dict[tuple[str, int], Iterator[int]] = {}
        self._deep: dict[tuple[str, int], frozenset[int]] = {}

    def next(self, model: str, level: int, partitions: int) -> int:
        if partitions == 1:
            return 0
        turn = self._turns.get((model, level))
        if turn is None:
            turn = self._turns[(model, level)] = itertools.count()
        deep = self._deep.get((model, level), frozenset())
        for _ in range(partitions):
            partition = next(turn) % partitions
            if partition not in deep:
                return partition
        return partition

    def observe(self, model: str, level: int, depths: Sequence[int], batch: int) -> None:
        """The entries each partition of the model's `level` holds; `batch`: how many more
        than the shallowest one may hold before it is passed over."""
        low = min(depths, default=0)
        self._deep[(model, level)] = frozenset(
            p for p, depth in enumerate(depths) if depth > low + batch
        )
