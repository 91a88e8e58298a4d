"""Triton's model_transaction_policy: whether a model is decoupled (zero or more responses per
request, the last one flagged final) rather than answering each request once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_decoupled(config: Mapping[str, Any] | None) -> bool:
    """`model_transaction_policy { decoupled: true }` in a model's config JSON."""
    policy = (config or {}).get("model_transaction_policy") or {}
    return bool(policy.get("decoupled", False))
