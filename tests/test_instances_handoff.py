"""Starting a batch on an instance's thread hands that thread the GIL: by the time `start`
returns, the thread has stacked the inputs and called the model, so the loop's own Python
does not hold it up."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import torch
from sluice.shared.model_config import load_model_config
from sluice.workers.instances.lanes import Instances
from sluice.workers.instances.stacked import StackedInstance

from tests.streams import int_model_config, int_request

CONFIG = int_model_config("gate")

#: long enough that only a missing hand-off lets `start` return before the model is called.
WAIT_S = 60.0
CPU = torch.device("cpu")


def test_start_returns_once_the_instance_thread_has_called_the_model(tmp_path: Path) -> None:
    (tmp_path / "gate").mkdir()
    (tmp_path / "gate" / "config.pbtxt").write_text(CONFIG)
    spec = load_model_config(tmp_path / "gate")
    called, release = threading.Event(), threading.Event()
    callers: list[threading.Thread] = []

    def infer(inputs: dict[str, Any]) -> dict[str, Any]:
        callers.append(threading.current_thread())
        called.set()
        release.wait(WAIT_S)
        return {"OUT": inputs["IN"] + 1}

    async def run() -> None:
        lanes = {1: [StackedInstance(spec, infer, CPU)]}
        instances = Instances(spec, lanes, CPU, handoff_timeout_s=WAIT_S)
        running = instances.start(0, [int_request(4, "test")], [1])
        try:
            # the stacking and the call happened before `start` returned, not at the next await
            assert called.is_set()
            assert callers[0] is not threading.main_thread()
        finally:
            release.set()
            outputs, _ = await running
            instances.shutdown()
        assert bytes(outputs[0][0].data) == (5).to_bytes(8, "little")

    asyncio.run(run())
