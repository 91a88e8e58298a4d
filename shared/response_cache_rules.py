"""Which models Triton's response cache may serve: the config's switch and its load errors.

A model turns the cache on with `response_cache { enable: true }`; a server without a cache
(`--cache-config`) ignores it. Decoupled models and the sequence batcher cannot be cached, and
Triton refuses to load such a config; an ensemble caches its top-level responses only when
none of its steps is such a model (its steps need not cache themselves).
"""

from __future__ import annotations

from typing import Any

from sluice.shared.transaction_policy import is_decoupled


def cache_enabled(config: dict[str, Any]) -> bool:
    """The config's `response_cache { enable }` (off when absent, as in Triton)."""
    section = config.get("response_cache") or {}
    return isinstance(section, dict) and bool(section.get("enable", False))


def cache_problem(config: dict[str, Any]) -> str | None:
    """Triton's load error for a config that enables the cache where it cannot serve."""
    if not cache_enabled(config):
        return None
    name = config.get("name", "")
    if is_decoupled(config):
        return (
            f"Response Cache does not currently support model {name} with 'decoupled' "
            "transaction policy. Please disable the response cache."
        )
    if "sequence_batching" in config:
        return (
            f"Response Cache does not currently support model {name} with sequence batching "
            "scheduler. Please disable the response cache."
        )
    return None
