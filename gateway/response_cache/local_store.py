"""Triton's `local` cache: one LRU of entries in this gateway's memory, bounded in bytes."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

#: what an entry costs beside its bytes (its key, the dict's slot), so that many tiny
#: entries cannot hold more memory than the size allows.
ENTRY_OVERHEAD = 128


@dataclass(slots=True)
class LocalCounts:
    """The cache's own figures, Triton's polled nv_cache_* gauges."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    lookup_ns: int = 0
    insertion_ns: int = 0


class LocalStore:
    """Entries by key, the least recently used evicted first once `size` bytes are held."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.used = 0
        self.counts = LocalCounts()
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: bytes) -> bytes | None:
        started = time.perf_counter_ns()
        entry = self._entries.get(key)
        self.counts.lookups += 1
        if entry is None:
            self.counts.misses += 1
        else:
            self.counts.hits += 1
            self._entries.move_to_end(key)
        self.counts.lookup_ns += time.perf_counter_ns() - started
        return entry

    async def put(self, key: bytes, entry: bytes) -> None:
        """Keep `entry`, evicting the oldest as needed; one larger than the cache is dropped."""
        started = time.perf_counter_ns()
        cost = len(entry) + ENTRY_OVERHEAD
        if cost > self.size:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.used -= len(old) + ENTRY_OVERHEAD
        while self.used + cost > self.size:
            _, evicted = self._entries.popitem(last=False)
            self.used -= len(evicted) + ENTRY_OVERHEAD
            self.counts.evictions += 1
        self._entries[key] = entry
        self.used += cost
        self.counts.insertion_ns += time.perf_counter_ns() - started
