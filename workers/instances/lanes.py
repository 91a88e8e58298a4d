"""A model's instances inside a worker: where a batch runs, and who answers for a failure.

Each instance (a lane) runs on a thread of its own, so the worker's event loop keeps reading and
publishing while the model runs; a batch may also run right on the loop when nothing else could use
it meanwhile (see `sluice.workers.batching.batcher.runs_inline`). When the model raises on a batch,
the halves are run again until only the request that fails is answered with the error. A Triton
Python model answers for each request itself (an exception from its `execute` fails that call's
requests, as in Triton): it is never split, and never runs on the loop, where a BLS call waiting on
a model of this same worker would hold up the loop that serves it.

Starting a batch on a lane's thread hands it the GIL: the loop waits (GIL released) until the
thread has stacked the inputs and calls the model, which runs without the GIL. Left to
itself the loop goes on with its own Python (answering the batch before, reading the next
requests) and the thread, woken, waits for the GIL, with the instance idle all the while
(benchmarks/RESULTS.md, "the next batch handed to the instance thread at once").
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from sluice.shared.errors import ModelExecutionError, SluiceError
from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import Request, Result
from sluice.shared.stats import BatchStats
from sluice.workers.backends import instance_devices
from sluice.workers.devices.cuda_staging import CudaStaging
from sluice.workers.devices.stage_ahead import StageAhead
from sluice.workers.instances.model_instance import (
    Answer,
    Answered,
    Batch,
    BatchOutputs,
    Capabilities,
    ModelInstance,
    Responses,
)

log = logging.getLogger(__name__)

#: the longest the loop waits for a lane's thread to take a batch up; a bound, as the thread
#: normally takes it up far sooner.
HANDOFF_TIMEOUT_S = 0.002


class Instances:
    """`spec.instance_count` lanes per served version, each with its own thread."""

    def __init__(
        self,
        spec: ModelSpec,
        instances: dict[int, list[ModelInstance]],
        device: torch.device,
        responses: Responses | None = None,
        handoff_timeout_s: float = HANDOFF_TIMEOUT_S,
        stage_ahead: bool | None = None,
    ) -> None:
        """`responses`: where a decoupled model's responses go; `stage_ahead`: make a full
        next batch's inputs while every lane is busy (None: on a GPU, when every lane is on
        the same one)."""
        self.spec = spec
        #: version -> one instance per lane.
        self.by_version = instances
        self.responses = responses
        #: what the queue may do with the model's batches, from its instances' own.
        self.capabilities = Capabilities.of_model(instances)
        #: a failing batch is run again in halves to find its culprit; never a sequence
        #: model's, whose state a second run would advance twice.
        self.splits = not self.capabilities.answers_each and not spec.config.sequence_batched
        self.default_version = max(instances)
        self.device = device
        #: each lane's CUDA stream and pinned buffers (None: a lane on the CPU); a lane's
        #: device is where `instance_devices` placed the instance of its index.
        on_gpu = device.type == "cuda"
        lane_devices = instance_devices(spec) if on_gpu else (device,) * spec.instance_count
        self._staging = [CudaStaging(d) if d.type == "cuda" else None for d in lane_devices]
        self.handoff_timeout_s = handoff_timeout_s
        #: wall time of the model's last successful run (None: no run yet, or the model must
        #: not run on the loop: `runs_inline` then says no).
        self.last_run_ns: int | None = None
        if stage_ahead is None:
            stage_ahead = on_gpu and len(set(lane_devices)) == 1
        #: the next batch's inputs, made while every lane is busy (None: not done here).
        self.ahead = (
            StageAhead(spec, lane_devices[0])
            if stage_ahead and not self.capabilities.answers_each
            else None
        )
        self._closed = False
        self._pool = ThreadPoolExecutor(
            spec.instance_count, thread_name_prefix=spec.name, initializer=adopt_torch_threads
        )
        # made on the event loop's thread, which runs batches too (`start(here=True)`)
        adopt_torch_threads()

    def start(
        self, lane: int, requests: Sequence[Request], sizes: Sequence[int], here: bool = False
    ) -> asyncio.Future[BatchOutputs]:
        """The batch's run on its lane's thread, taken up by it by the time this returns (or
        after `handoff_timeout_s`), or done right here (`here`)."""
        instance = self.by_version[requests[0].version][lane]
        staging = self._staging[lane]
        staged = self.ahead.take(requests) if self.ahead is not None else None
        loop = asyncio.get_running_loop()
        if not here:
            stacked = threading.Event()
            batch = Batch(requests, sizes, stacked.set, staging, staged, self.responses)
            running = loop.run_in_executor(self._pool, instance.run, batch)
            stacked.wait(self.handoff_timeout_s)
            return running
        done: asyncio.Future[BatchOutputs] = loop.create_future()
        try:
            done.set_result(
                instance.run(
                    Batch(requests, sizes, staging=staging, staged=staged, responses=self.responses)
                )
            )
        except Exception as exc:  # reported by run_isolating, as from the lane's thread
            done.set_exception(exc)
        return done

    async def run_isolating(
        self,
        lane: int,
        requests: Sequence[Request],
        sizes: Sequence[int],
        stats: BatchStats,
        running: asyncio.Future[BatchOutputs] | None = None,
    ) -> list[Result]:
        """Run a batch (or await its run, already started); if the model raises, re-run the
        halves so only the culprit fails."""
        try:
            started = running if running is not None else self.start(lane, requests, sizes)
            outputs, timing = await started
        except Exception as exc:  # the model's own failure, reported to its request
            if len(requests) > 1 and self.splits:
                middle = len(requests) // 2
                return [
                    *await self.run_isolating(lane, requests[:middle], sizes[:middle], stats),
                    *await self.run_isolating(lane, requests[middle:], sizes[middle:], stats),
                ]
            error = (
                exc
                if isinstance(exc, ModelExecutionError)
                else ModelExecutionError(f"model '{self.spec.name}' failed: {exc}")
            )
            log.warning("%s: request %s failed: %s", self.spec.name, requests[0].id, exc)
            return [Result(r.id, error=(error.code, error.message)) for r in requests]
        stats.input_ns += timing.input_ns
        stats.infer_ns += timing.infer_ns
        stats.output_ns += timing.output_ns
        if not self.capabilities.answers_each:
            self.last_run_ns = timing.input_ns + timing.infer_ns + timing.output_ns
        return [_result(r, outs) for r, outs in zip(requests, outputs, strict=True)]

    def shutdown(self) -> None:
        """Wait for the runs in progress, then let the threads and the instances go (a
        Triton Python model's `finalize()` runs once, whoever calls this first)."""
        self._pool.shutdown(wait=True)
        if self._closed:
            return
        self._closed = True
        if self.ahead is not None:
            log.info(
                "%s: %d batches ran on inputs staged ahead, %d stagings dropped",
                self.spec.name,
                self.ahead.used,
                self.ahead.dropped,
            )
        for lanes in self.by_version.values():
            for instance in lanes:
                instance.close()


def adopt_torch_threads() -> None:
    """Give the calling thread (an instance's, or the event loop's: both run batches) the
    process's torch thread count.

    OpenMP keeps its thread count per thread, and torch applies its own count to a thread
    other than the one that set it only on the first operator large enough to split. Until
    then MKL runs every matrix product of small batches on a team of all the cores, whatever
    INTRA_OP_THREAD_COUNT says, and the team's spare thread spins between products.
    """
    torch.set_num_threads(torch.get_num_threads())


def _result(request: Request, answer: Answer) -> Result:
    if isinstance(answer, SluiceError):
        return Result(request.id, error=(answer.code, answer.message))
    if isinstance(answer, Answered):
        if answer.error is not None:
            failure = (answer.error.code, answer.error.message)
            return Result(request.id, error=failure, answered_by_model=True)
        return Result(request.id, answer.outputs, parameters=answer.parameters or None)
    return Result(request.id, answer)
