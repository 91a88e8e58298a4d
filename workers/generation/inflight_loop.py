"""An iterative model's queue loop: requests in hand join its instances' running sets, and
every instance steps its sequences until they end (in place of the batch loop).

A model is iterative when its config says `sequence_batching { iterative_sequence: true }` (Triton's
in-flight batching) and its `model.py` has sluice's generative contract
(workers/generation/generation.py). Each instance runs its own `Generation`; the requests the reader
put in hand go, in the queue's order, to the instance of their version with the most room, only as
many as join at its next iteration, so the reader reads on (a batch's worth ahead) while the others
stay in the streams for other workers. Responses go through the model queue's `ResponseStream`,
which acks each request with its final one; the generation statistics go with the queue's others.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from sluice.shared.errors import SluiceError
from sluice.shared.model_config import ModelSpec
from sluice.shared.sequence_controls import SEQUENCE_ID
from sluice.workers.answers.streamed import ResponseStream
from sluice.workers.batching.answering import Answering
from sluice.workers.batching.pending import Queued
from sluice.workers.batching.queue_state import QueueState
from sluice.workers.generation.generation import Generation
from sluice.workers.generation.generation_stats import GenerationStats
from sluice.workers.generation.inflight import InflightScheduler, Limits
from sluice.workers.instances.lanes import Instances, adopt_torch_threads
from sluice.workers.instances.model_instance import GenerativeModel, ModelInstance

#: the model parameter that sets an iteration's token budget (0 or absent: none).
TOKEN_BUDGET = "MAX_NUM_BATCHED_TOKENS"
#: generation statistics are written at most this often while sequences run.
STATS_FLUSH_S = 0.5


def limits(spec: ModelSpec) -> Limits:
    """max_batch_size sequences per instance, and the model's token budget."""
    budget = spec.parameters.get(TOKEN_BUDGET, "0")
    if not budget.isdigit():
        raise ValueError(f"model '{spec.name}': parameter {TOKEN_BUDGET} must be an integer")
    return Limits(max(1, spec.max_batch_size), int(budget))


class InflightLoop:
    """Runs an iterative model's instances until the queue stops and every sequence ended."""

    def __init__(
        self,
        spec: ModelSpec,
        state: QueueState,
        instances: Instances,
        answering: Answering,
        responses: ResponseStream,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.answering = answering
        self.responses = responses
        self.stats = GenerationStats()
        self._sequence_ids = itertools.count(1)
        self._clock_s = clock_s
        self._flushed_at_s = clock_s()
        self._pool = ThreadPoolExecutor(
            spec.instance_count, thread_name_prefix=spec.name, initializer=adopt_torch_threads
        )
        #: version -> one generation per instance.
        self.generations: dict[int, list[Generation]] = {
            version: [
                Generation(
                    spec,
                    _generative(instance, responses),
                    InflightScheduler(limits(spec)),
                    responses,
                    self.stats,
                    self._on_thread,
                )
                for instance in lanes
            ]
            for version, lanes in instances.by_version.items()
        }

    async def _on_thread(self, call: Callable[[], Any]) -> Any:
        def run() -> Any:
            with torch.inference_mode():
                return call()

        return await asyncio.get_running_loop().run_in_executor(self._pool, run)

    @property
    def _all(self) -> list[Generation]:
        return [g for lanes in self.generations.values() for g in lanes]

    @property
    def _running(self) -> int:
        return sum(len(g.scheduler.running) + len(g.scheduler.waiting) for g in self._all)

    async def run(self) -> None:
        state = self.state
        try:
            while not (state.finished and not self._running):
                await self.answering.expire(state.expired(time.time_ns()))
                self._admit(state.take_in_hand(self._room()))
                state.sequences_running(self._running)
                self.stats.sequences(
                    sum(len(g.scheduler.running) for g in self._all),
                    sum(len(g.scheduler.waiting) for g in self._all) + len(state.pending),
                )
                busy = [g for g in self._all if not g.scheduler.idle]
                if not busy:
                    state.wake.clear()  # before the flush's await: a read meanwhile wakes us
                    await self._flush_stats(force=True)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(state.wake.wait(), self._next_expiry_s())
                    continue
                await asyncio.gather(*(g.iterate() for g in busy))
                for _ in busy:  # an iteration counts as a batch in `sluice status`
                    state.results_published()
                await self._flush_stats(force=False)
        finally:
            state.sequences_running(0)
            await self._flush_stats(force=True)
            self._pool.shutdown(wait=True)

    def _room(self) -> int:
        """How many requests in hand the instances take now: as many as join them at their
        next iteration."""
        return sum(g.scheduler.room for g in self._all)

    def _admit(self, items: list[Queued]) -> None:
        for item in items:
            self._identify(item.request.parameters)
            lanes = self.generations[item.request.version]
            generation = max(lanes, key=lambda g: g.scheduler.room)
            self.responses.open([item])
            try:
                generation.submit(item.request, item.level)
            except SluiceError as exc:  # a bad max_tokens: answered, never joins
                self.responses.end(item.request, exc)

    def _identify(self, parameters: dict[str, Any]) -> None:
        """A request that names no sequence gets the next id, counted from 1, as Triton's
        iterative sequencer gives each one (its model reads it as CORRID)."""
        if not parameters.get(SEQUENCE_ID):
            parameters[SEQUENCE_ID] = next(self._sequence_ids)

    def _next_expiry_s(self) -> float | None:
        expiry_ns = self.state.pending.next_expiry_ns()
        return None if expiry_ns is None else max(0.0, (expiry_ns - time.time_ns()) / 1e9)

    async def _flush_stats(self, force: bool) -> None:
        if not force and self._clock_s() - self._flushed_at_s < STATS_FLUSH_S:
            return
        self._flushed_at_s = self._clock_s()
        increments = self.stats.take_increments()
        if increments:
            await self.answering.publisher.publish([], [], increments)


def _generative(instance: ModelInstance, responses: ResponseStream) -> GenerativeModel:
    """The instance's generative contract, its responses going to the queue's stream."""
    model = instance.generative_model(responses)
    if model is None:
        raise TypeError("an iterative model's instances must be generative")
    return model
