"""A generative model's iterations on one instance: prefill who joins, step everyone, respond.

sluice's generative contract (docs/models.md) is a python model's `Model` class with
`prefill(prompts) -> state` (the new sequences' state, one row each), `step(state) ->
(outputs, finished)` (one token for every row: outputs with one row per sequence, and which
rows ended, e.g. on a stop token), and `join(state, joining) -> state` / `keep(state, rows)
-> state` that let sequences join and leave between steps. `prompt_tokens(prompt) -> int`,
if defined, counts a prompt against the token budget. The state is the model's own (a KV
cache, a recurrent state): it stays on this worker between iterations.

Before every step the scheduler (workers/generation/inflight.py) says who leaves and who joins.
Every step's token goes out at once as a response of its own; a sequence's last one is final: the
model's stop, or the request's `max_tokens` (else the model's MAX_TOKENS parameter). A cancelled
sequence gets a final CANCELLED error. A failing prefill fails only the sequences that were joining;
a failing step, join or keep, every running one (their state is lost with it). Every call into the
model runs off the event loop (`run`: the instance's thread).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from sluice.shared.datatypes import NUMPY_DTYPE, deserialize_bytes_elements
from sluice.shared.errors import Cancelled, InvalidInput, ModelExecutionError, SluiceError
from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import Request
from sluice.workers.generation.generation_stats import GenerationStats
from sluice.workers.generation.inflight import InflightScheduler, Iteration
from sluice.workers.generation.inflight import Sequence as Running
from sluice.workers.instances.model_instance import (
    GenerativeModel,
    Prompt,
    Responses,
)
from sluice.workers.instances.stacked import split

X = TypeVar("X")

#: the request parameter that caps a sequence's tokens, and the model parameter that sets
#: its default.
MAX_TOKENS = "max_tokens"
MAX_TOKENS_PARAMETER = "MAX_TOKENS"
DEFAULT_MAX_TOKENS = 256
CANCELLED = "Request was cancelled: the client disconnected"


def prompt_of(request: Request) -> Prompt:
    inputs: dict[str, np.ndarray] = {}
    for tensor in request.inputs:
        if tensor.datatype == "BYTES":
            array = np.empty(len(deserialize_bytes_elements(tensor.data)), dtype=object)
            array[:] = deserialize_bytes_elements(tensor.data)
        else:
            array = np.frombuffer(tensor.data, dtype=NUMPY_DTYPE[tensor.datatype])
        inputs[tensor.name] = array.reshape(tensor.shape)
    return Prompt(inputs, request.parameters, request)


def max_tokens(spec: ModelSpec, parameters: Mapping[str, Any]) -> int:
    """The request's `max_tokens`, else the model's MAX_TOKENS (InvalidInput if not > 0)."""
    value = parameters.get(MAX_TOKENS, spec.parameters.get(MAX_TOKENS_PARAMETER))
    if value is None:
        return DEFAULT_MAX_TOKENS
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidInput(f"request parameter '{MAX_TOKENS}' must be a positive integer")
    return value


@dataclass(slots=True)
class Progress:
    """How far a running sequence got."""

    limit: int
    tokens: int = 0
    last_ns: int = 0


async def _on_thread(call: Callable[[], X]) -> X:
    return await asyncio.to_thread(call)


@dataclass(slots=True)
class Generation:
    """One instance's generation loop over the scheduler's running set."""

    spec: ModelSpec
    model: GenerativeModel
    scheduler: InflightScheduler[Request]
    responses: Responses
    stats: GenerationStats = field(default_factory=GenerationStats)
    #: runs the model's calls off the event loop (the instance's thread).
    run: Callable[[Callable[[], Any]], Awaitable[Any]] = _on_thread
    clock_ns: Callable[[], int] = time.time_ns
    state: Any = None
    progress: dict[str, Progress] = field(default_factory=dict)

    def submit(self, request: Request, level: int = 0) -> None:
        """Queue a request (InvalidInput for a bad `max_tokens`: answer it, it never joins)."""
        limit = max_tokens(self.spec, request.parameters)
        count = getattr(self.model, "prompt_tokens", None)
        try:
            tokens = int(count(prompt_of(request))) if count is not None else 1
        except Exception as exc:  # the model's own code: this request alone fails
            raise ModelExecutionError(f"model '{self.spec.name}' failed: {exc}") from exc
        self.progress[request.id] = Progress(limit)
        self.scheduler.submit(request.id, request, level, tokens)

    def _cancel(self) -> None:
        """Sequences whose client went away leave: a waiting one now, a running one before
        this iteration."""
        for sequence in [*self.scheduler.waiting, *self.scheduler.running]:
            if not sequence.done and self.responses.is_cancelled(sequence.key):
                waiting = self.scheduler.cancel(sequence.key)
                if waiting is not None:
                    self._end(waiting.item, Cancelled(CANCELLED))

    async def iterate(self) -> None:
        """One iteration: sequences leave and join, then every running one gets a token."""
        self._cancel()
        plan = self.scheduler.next_iteration()
        for gone in plan.left:
            if gone.cancelled:
                self._end(gone.item, Cancelled(CANCELLED))
            self.progress.pop(gone.key, None)
        if not await self._leave(plan):
            return
        if plan.joining:
            await self._prefill(plan.joining)
        if self.scheduler.running:
            await self._step()

    async def _leave(self, plan: Iteration[Request]) -> bool:
        """Drop the rows that left the state (False: the model failed, and every sequence)."""
        if self.state is None or not plan.left:
            return True
        rows, state = plan.keep, self.state
        try:
            self.state = await self.run(lambda: self.model.keep(state, rows)) if rows else None
        except Exception as exc:
            self._fail_all(exc)
            return False
        return True

    async def _prefill(self, joining: list[Running[Request]]) -> None:
        prompts = [prompt_of(s.item) for s in joining]
        try:
            new = await self.run(lambda: self.model.prefill(prompts))
        except Exception as exc:  # the model's own failure: only the joining ones fail
            self.scheduler.drop(joining)
            self._fail(joining, exc)
            return
        state = self.state
        try:
            self.state = (
                new if state is None else await self.run(lambda: self.model.join(state, new))
            )
        except Exception as exc:
            self._fail_all(exc)
            return
        for sequence in joining:
            self.stats.prompt_tokens(sequence.item.version, sequence.prompt_tokens)

    async def _step(self) -> None:
        running = self.scheduler.running
        try:
            outputs, finished = await self.run(lambda: self.model.step(self.state))
            requests = [s.item for s in running]
            rows = None
            if outputs is not None:
                rows = split(self.spec, requests, [1] * len(running), dict(outputs))
            if len(finished) != len(running):
                raise ModelExecutionError(
                    f"model '{self.spec.name}' finished {len(finished)} rows of {len(running)}"
                )
        except Exception as exc:
            self._fail_all(exc)
            return
        now_ns = self.clock_ns()
        self.stats.iteration(running[0].item.version, len(running))
        if rows is None:  # answered by the model itself
            for sequence, stopped in zip(running, finished, strict=True):
                if stopped:
                    self.scheduler.finish(sequence.key)
                    self.stats.finished(sequence.item, now_ns)
            return
        for sequence, tensors, stopped in zip(running, rows, finished, strict=True):
            progress = self.progress[sequence.key]
            progress.tokens += 1
            self.stats.token(sequence.item, now_ns, progress.last_ns)
            progress.last_ns = now_ns
            final = bool(stopped) or progress.tokens >= progress.limit
            if final:
                self.scheduler.finish(sequence.key)
                self.stats.finished(sequence.item, now_ns)
            self.responses.send_tensors(sequence.item, tensors, None, final)

    def _fail_all(self, exc: Exception) -> None:
        """The model failed on its state: every running sequence ends, the state with them."""
        self.state = None
        self._fail(self.scheduler.fail_running(), exc)

    def _fail(self, sequences: list[Running[Request]], exc: Exception) -> None:
        error = (
            exc
            if isinstance(exc, ModelExecutionError)
            else ModelExecutionError(f"model '{self.spec.name}' failed: {exc}")
        )
        for sequence in sequences:
            self._end(sequence.item, error)

    def _end(self, request: Request, error: SluiceError) -> None:
        """The request's final response, an error (unless its model already sent one)."""
        self.progress.pop(request.id, None)
        self.stats.failed(request.version, "CANCELED" if error.code == "CANCELLED" else "BACKEND")
        self.responses.end(request, error)
