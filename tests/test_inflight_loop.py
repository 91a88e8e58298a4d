"""The in-flight loop of a model queue: requests in hand join the instances, and a request
read while the loop goes idle is not left waiting."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sluice.shared.errors import SluiceError
from sluice.shared.model_config import load_model_config
from sluice.shared.protocol import Request, Tensor
from sluice.workers.batching.batcher import Pending
from sluice.workers.batching.model_queue import batch_rules
from sluice.workers.batching.pending import Queued
from sluice.workers.batching.queue_state import QueueState
from sluice.workers.generation.inflight_loop import InflightLoop
from sluice.workers.instances.generative import GenerativeInstance

from tests.counter_model import CONFIG, Counter, request


class Finals:
    """A ResponseStream that only records which requests ended."""

    def __init__(self) -> None:
        self.ended: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.opened: list[str] = []

    def open(self, items: Sequence[Queued]) -> None:
        self.opened += [item.request.id for item in items]

    def send_tensors(
        self,
        request: Request,
        tensors: Sequence[Tensor],
        error: SluiceError | None = None,
        final: bool = False,
    ) -> None:
        if final:
            self.ended[request.id].set()

    def end(self, request: Request, error: SluiceError) -> bool:
        self.ended[request.id].set()
        return True

    def is_cancelled(self, request_id: str) -> bool:
        return False


def queued(rid: str, length: int) -> Queued:
    return Queued(request(rid, length), "stream", rid.encode(), Pending(None, 1, 0))


def test_a_request_read_while_the_loop_flushes_its_statistics_runs(tmp_path: Path) -> None:
    """The loop goes idle after `a` and writes its statistics; `b` is read during that write.
    The loop must not then sleep as if nothing were in hand."""
    (tmp_path / "counter").mkdir()
    (tmp_path / "counter" / "config.pbtxt").write_text(CONFIG)
    spec = load_model_config(tmp_path / "counter")

    async def scenario() -> None:
        state = QueueState(batch_rules(spec), 1, 1)
        finals = Finals()
        b_read: list[bool] = []

        async def publish(items: Any, results: Any, increments: Any = ()) -> None:
            if not b_read:  # b is read while a's statistics are written
                b_read.append(True)
                state.queued(queued("b", 1))
                state.requests_read()

        answering = SimpleNamespace(
            expire=lambda expired: asyncio.sleep(0), publisher=SimpleNamespace(publish=publish)
        )
        model = Counter()
        lane = GenerativeInstance(lambda _: model, lambda: None, "counter")
        instances = SimpleNamespace(by_version={1: [lane]})
        loop = InflightLoop(spec, state, instances, answering, finals)  # type: ignore[arg-type]
        running = asyncio.create_task(loop.run())
        state.queued(queued("a", 2))
        state.requests_read()
        await asyncio.wait_for(finals.ended["a"].wait(), 60)
        await asyncio.wait_for(finals.ended["b"].wait(), 60)  # hangs if the wake-up was lost
        state.stop_requested()
        await running
        assert finals.opened == ["a", "b"]

    asyncio.run(scenario())
