"""Which model's code runs: one worker process serves many models, where Triton runs one model
per stub process, so what a model's code calls (`get_model_dir()`, a metric it creates) learns
its model from here."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: the version directory of the model whose code runs (set around its import, initialize,
#: execute and finalize).
model_dir: contextvars.ContextVar[Path | None] = contextvars.ContextVar("model_dir", default=None)


def current_model() -> str:
    """The running model's name; "" outside its calls (e.g. a thread of its own)."""
    current = model_dir.get()
    return current.parent.name if current is not None else ""


class Instance:
    """Stands for one model instance while its code runs: the metric families it creates go
    with it (custom_metrics.release), as they go with a Triton stub process."""

    __slots__ = ("__weakref__", "name")

    def __init__(self, name: str = "") -> None:
        #: Triton's instance name (`model_instance_name`), which Triton's messages name.
        self.name = name


#: the instance whose code runs.
instance: contextvars.ContextVar[Instance | None] = contextvars.ContextVar("instance", default=None)


def current_instance_name() -> str:
    """The running instance's name as Triton's messages give it (its model's name if it has
    none); "" outside a model's calls."""
    running_instance = instance.get()
    return (running_instance.name if running_instance is not None else "") or current_model()


@contextmanager
def running(version_dir: Path, owner: Instance) -> Iterator[None]:
    """Around a model instance's code: its version directory and the instance itself."""
    directory, running_instance = model_dir.set(version_dir), instance.set(owner)
    try:
        yield
    finally:
        instance.reset(running_instance)
        model_dir.reset(directory)
