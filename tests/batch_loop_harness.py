"""A batch loop driven without Redis: requests queued by hand, launches run on real instances
and their answers kept (the part of Answering the batch loop calls)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
from sluice.shared.model_config import ModelSpec, load_model_config
from sluice.shared.protocol import Request
from sluice.workers.batching.batcher import Pending
from sluice.workers.batching.pending import Queued
from sluice.workers.batching.queue_state import QueueState
from sluice.workers.instances.lanes import Instances

from tests.streams import int_model_config


def add_model(root: Path) -> ModelSpec:
    """The INT64 "add" model's config, served by a callable of the test's."""
    (root / "add").mkdir()
    (root / "add" / "config.pbtxt").write_text(
        int_model_config("add").replace('backend: "python"', 'platform: "pytorch_libtorch"')
    )
    return load_model_config(root / "add")


def queued(state: QueueState, request: Request, at_ns: int) -> Queued:
    item = Queued(request, "s", b"1-0", Pending(1, 1, at_ns), seq=at_ns)
    state.arrived(at_ns)
    state.queued(item)
    state.requests_read()
    return item


def values(outputs: Any) -> list[int]:
    return [int(np.frombuffer(tensors[0].data, np.int64)[0]) for tensors in outputs]


class Launches:
    """The part of Answering the batch loop calls: each launch runs on the instances and its
    answers are kept; nothing is published."""

    def __init__(self, state: QueueState, instances: Instances) -> None:
        self.state, self.instances = state, instances
        self.answers: list[list[int]] = []
        #: for each answer, whether a run made before its batch was formed gave it.
        self.early: list[bool] = []
        self.answered = asyncio.Event()
        self._runs: set[asyncio.Future[None]] = set()

    async def expire(self, expired: list[Any]) -> None:
        assert not expired

    def start(self, launch: Any, early: Any = None, dropped: bool = False) -> None:
        requests = [q.request for q in launch.batch]
        if early is not None:
            running = early.running
        else:
            running = self.instances.start(
                launch.lane, requests, [1] * len(requests), launch.inline
            )
        self.early.append(early is not None)
        task = asyncio.ensure_future(self._answer(launch, running))
        self._runs.add(task)
        task.add_done_callback(self._runs.discard)

    async def _answer(self, launch: Any, running: Any) -> None:
        outputs, _ = await running
        self.answers.append(values(outputs))
        self.answered.set()
        if launch.inline:
            self.state.inline_answered(launch.lane)
        else:
            self.state.batch_finished(launch.lane)
