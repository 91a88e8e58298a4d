"""Triton's in-flight batching for Python models: a decoupled `TritonPythonModel` under
`sequence_batching { iterative_sequence: true }`, driven by the same generation loop as
sluice's own generative contract (workers/generation/generation.py).

Every iteration calls `execute` with the instance's running requests, the joining ones after
those kept. The model answers through each request's response sender, and calls
`request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)` on those it
wants again: the others leave the running set (a request the model releases must have had
its final response, as in Triton). `execute` must return None; an `async def execute` is
waited for, since the next iteration needs its release flags.

As Triton's iterative sequencer does, each request is a sequence of its own: its correlation id
is the one the in-flight loop gave it (workers/generation/inflight_loop.py), its first
iteration has the START flag and later ones none, and the config's control inputs (START, END,
READY, CORRID) are among its inputs, END false and READY true.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from typing import Any

from sluice.shared.errors import ModelExecutionError
from sluice.shared.model_config import ModelSpec
from sluice.shared.sequence_controls import Flags
from sluice.workers.instances.model_instance import Prompt, Responses
from sluice.workers.python_backend.instance import TritonInstance
from sluice.workers.python_backend.messages import (
    FLAG_SEQUENCE_START,
    RELEASE_ALL,
    RELEASE_RESCHEDULE,
    InferenceRequest,
)
from sluice.workers.python_backend.pb_utils import model_dir
from sluice.workers.python_backend.tensors import Tensor


class TritonIterative:
    """A Triton Python model's instance with the generative contract; the state is the
    running requests as `execute` gets them, each with its sender to `responses`."""

    def __init__(self, instance: TritonInstance, responses: Responses, spec: ModelSpec) -> None:
        self.instance = instance
        self.responses = responses
        self.controls = spec.config.sequence_controls
        self.batched = spec.max_batch_size > 0

    def prefill(self, prompts: Sequence[Prompt]) -> list[InferenceRequest]:
        joining = [self.instance.server_request(p.request, self.responses) for p in prompts]
        for request in joining:
            request.reschedulable = True
            self._mark(request, start=True)
        return joining

    def step(self, state: list[InferenceRequest]) -> tuple[None, list[bool]]:
        for request in state:
            request.release_flags = RELEASE_ALL
        token = model_dir.set(self.instance.version_dir)
        try:
            returned = self.instance.model.execute(state)
            if inspect.iscoroutine(returned):
                returned = asyncio.run(returned)
        except Exception as exc:  # the model's code: every running request fails
            raise self._failure(f"{type(exc).__name__}: {exc}") from exc
        finally:
            model_dir.reset(token)
        if returned is not None:
            raise self._failure(
                f"Python model '{self.instance.name}' is using the decoupled mode and the "
                "execute function must return None."
            )
        finished = [r.release_flags & RELEASE_RESCHEDULE == 0 for r in state]
        for request, done in zip(state, finished, strict=True):
            if not done and request.flags() & FLAG_SEQUENCE_START:
                self._mark(request, start=False)
        return None, finished

    def join(self, state: list[InferenceRequest], joining: list[Any]) -> list[InferenceRequest]:
        return [*state, *joining]

    def keep(self, state: list[InferenceRequest], rows: list[int]) -> list[InferenceRequest]:
        return [state[row] for row in rows]

    def _mark(self, request: InferenceRequest, start: bool) -> None:
        """The request's flags and control inputs for its next iteration."""
        flags = Flags(request.correlation_id(), start=start)
        controls = [Tensor(c.name, c.array(flags, self.batched)) for c in self.controls]
        request.set_sequence_controls(FLAG_SEQUENCE_START if start else 0, controls)

    def _failure(self, message: str) -> ModelExecutionError:
        return ModelExecutionError(
            f"Failed to process the request(s) for model '{self.instance.name}', message: {message}"
        )
