"""Garbage collection settled for long-running sluice processes.

CPython starts a young collection every 700 net container allocations; every tenth also walks
the middle generation and, now and then, one walks the whole heap, including every object the
imports left behind (torch, numpy, redis-py). A request allocates dozens of containers, so
under load the gateway ran dozens of collections a second and its full collections were the
longest pauses behind p99 (benchmarks/RESULTS.md, "garbage collection settled"). The request
path frees its objects by reference counting alone, so once a process has started, what it
allocated is frozen (never walked again) and the young generation may grow to `YOUNG_OBJECTS`
first. Under load that means no collection at all (benchmarks/gc_settling.py: the default
collector cost the gateway 26 us per inference at c=64), so nothing that holds memory may wait
for one: a reference cycle around a request's data is a leak (the HTTP server breaks its
connection-parser cycle when a connection closes).
"""

from __future__ import annotations

import gc

#: container allocations (net of frees) between two young-generation collections.
YOUNG_OBJECTS = 50_000


def settle_after_startup() -> None:
    """Call once the process holds what it keeps for its lifetime (models, clients)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_OBJECTS, *gc.get_threshold()[1:])
