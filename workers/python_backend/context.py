"""Which model's code runs: one worker process serves many models, where Triton runs one model
per stub process, so what a model's code calls (`get_model_dir()`, a metric it creates) learns
its model from here."""

from __future__ import annotations

import contextvars
from pathlib import Path

#: the version directory of the model whose code runs (set around its import, initialize,
#: execute and finalize).
model_dir: contextvars.ContextVar[Path | None] = contextvars.ContextVar("model_dir", default=None)


def current_model() -> str:
    """The running model's name; "" outside its calls (e.g. a thread of its own)."""
    current = model_dir.get()
    return current.parent.name if current is not None else ""
