"""The response cache as the gateway uses it: which models it serves, a lookup before a request
is queued, the insert of its response, and the figures each adds to the model's statistics
(Triton's cache_hit and cache_miss) and to /metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from sluice.gateway.model_table import ModelView
from sluice.gateway.response_cache.cache_stats import CacheStats
from sluice.gateway.response_cache.entry import pack_entry, unpack_entry
from sluice.gateway.response_cache.local_store import LocalStore
from sluice.gateway.response_cache.request_key import request_key
from sluice.gateway.triton_exposition import Family
from sluice.shared.config_view import ConfigView
from sluice.shared.infer_codec import ParsedInfer
from sluice.shared.protocol import ResponseParameter, Result, Tensor
from sluice.shared.stats import cache_hit_increments, cache_miss_increments


class Store(Protocol):
    async def get(self, key: bytes) -> bytes | None: ...

    async def put(self, key: bytes, entry: bytes) -> None: ...


@dataclass(slots=True)
class Lookup:
    """A lookup's key and outcome: the cached outputs and parameters on a hit."""

    model: str
    version: int
    key: bytes
    started_ns: int
    lookup_ns: int
    hit: tuple[list[Tensor], dict[str, ResponseParameter] | None] | None


class ResponseCache:
    """One gateway's cache (a local LRU, or the fleet's Redis) and its statistics."""

    def __init__(
        self,
        store: Store,
        stats: CacheStats,
        config_of: Callable[[str], ConfigView | None],
        clock_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self.store = store
        self.stats = stats
        self._config_of = config_of
        self._clock_ns = clock_ns

    def serves(self, view: ModelView) -> bool:
        """The model enables the cache and can be cached: an ensemble only when none of its
        steps is decoupled or sequence-batched (its steps need not enable the cache)."""
        config = view.config
        if config is None or not config.response_cache:
            return False
        return not config.is_ensemble or all(
            _cacheable(self._config_of(step)) for step in config.ensemble_steps
        )

    async def lookup(self, model: str, version: int, request: ParsedInfer) -> Lookup:
        started = self._clock_ns()
        outputs = request.outputs.keys() if request.outputs is not None else None
        key = request_key(model, version, request.inputs, outputs)
        entry = await self.store.get(key)
        hit = unpack_entry(entry) if entry is not None else None
        ended = self._clock_ns()
        if hit is not None:
            at_ms = time.time_ns() // 1_000_000
            self.stats.add(model, cache_hit_increments(version, ended - started, at_ms))
        return Lookup(model, version, key, started, ended - started, hit)

    async def insert(self, lookup: Lookup, result: Result) -> None:
        """Keep a miss's response, when it succeeded, and count the miss."""
        started = self._clock_ns()
        if result.error is None:
            await self.store.put(lookup.key, pack_entry(result.outputs, result.parameters))
        spent = lookup.lookup_ns + self._clock_ns() - started
        self.stats.add(lookup.model, cache_miss_increments(lookup.version, spent))

    def families(self) -> list[Family]:
        """Triton's polled gauges of a local cache (none for Redis, as Triton shows none)."""
        if not isinstance(self.store, LocalStore):
            return []
        store, counts = self.store, self.store.counts
        gauges: Sequence[tuple[str, str, float]] = (
            ("nv_cache_util", "Cache utilization [0.0 - 1.0]", store.used / store.size),
            ("nv_cache_num_entries", "Number of responses stored in response cache", len(store)),
            ("nv_cache_num_hits", "Number of cache hits in response cache", counts.hits),
            ("nv_cache_num_misses", "Number of cache misses in response cache", counts.misses),
            ("nv_cache_num_lookups", "Number of cache lookups in response cache", counts.lookups),
            (
                "nv_cache_num_evictions",
                "Number of cache evictions in response cache",
                counts.evictions,
            ),
            (
                "nv_cache_lookup_duration",
                "Total cache lookup duration (hit and miss), in microseconds",
                counts.lookup_ns // 1000,
            ),
            (
                "nv_cache_insertion_duration",
                "Total cache insertion duration, in microseconds",
                counts.insertion_ns // 1000,
            ),
        )
        families = []
        for name, help_text, value in gauges:
            family = Family(name, "gauge", help_text)
            family.add({}, value)
            families.append(family)
        return families


def _cacheable(config: ConfigView | None) -> bool:
    return config is not None and not config.decoupled and not config.sequence_batched
