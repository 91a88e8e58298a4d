"""The one contract every kind of model instance keeps: a batch in, one answer per request out.

A loaded instance is a `ModelInstance`, whatever its backend: plain tensor functions
(TorchScript, ONNX, TF, OpenVINO, FIL, TensorRT, .pt2, a sluice `class Model`) are a
`StackedInstance` (workers/instances/stacked.py), a Triton Python model a `TritonInstance`
(workers/python_backend/instance.py), a generative model a `GenerativeInstance`
(workers/instances/generative.py). The queue never asks which: it reads the instance's declared
`Capabilities` and hands it `Batch`es. Adding a kind of instance touches its own module and
the factory (`sluice.workers.backends.load_instance`) only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
from sluice.shared.errors import SluiceError
from sluice.shared.protocol import Request, ResponseParameter, Tensor
from sluice.workers.devices.cuda_staging import CudaStaging, Staged


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What the queue may do with an instance's batches."""

    #: the model answers each request itself (a failed call fails its requests, with no
    #: culprit to isolate): a batch is never split, never run on the event loop's thread,
    #: and its inputs are never staged ahead.
    answers_each: bool = False
    #: a run has no effects of its own, so a lone batch may run before its delay is out and
    #: be dropped (workers/batching/early_run.py).
    may_run_early: bool = True
    #: it steps sequences iteration by iteration in the in-flight loop (workers/
    #: inflight_loop.py) instead of running batches.
    generative: bool = False

    @staticmethod
    def of_model(instances: Mapping[int, Sequence[ModelInstance]]) -> Capabilities:
        """A model's, from its instances' by version (its versions may be of different
        kinds): it answers each request if any does, runs early only if all may, is
        generative if all are."""
        kinds = [lane.capabilities for lanes in instances.values() for lane in lanes]
        return Capabilities(
            answers_each=any(c.answers_each for c in kinds),
            may_run_early=all(c.may_run_early for c in kinds),
            generative=bool(kinds) and all(c.generative for c in kinds),
        )


class Responses(Protocol):
    """Where a decoupled or generative model's responses go: the model queue's
    ResponseStream (workers/answers/streamed.py), which publishes them in order and acks each
    request with its final one."""

    def send_tensors(
        self,
        request: Request,
        tensors: Sequence[Tensor],
        error: SluiceError | None = None,
        final: bool = False,
        parameters: dict[str, ResponseParameter] | None = None,
    ) -> None: ...

    def end(self, request: Request, error: SluiceError) -> bool: ...

    def is_cancelled(self, request_id: str) -> bool: ...


def _nothing() -> None:
    return None


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch as an instance runs it (in the instance's thread)."""

    requests: Sequence[Request]
    #: each request's rows.
    sizes: Sequence[int]
    #: called once the inputs are handed over (stacked, or made the model's request
    #: objects), or failed to be, just before the model runs: the lane's hand-off.
    stacked: Callable[[], None] = _nothing
    #: the lane's CUDA stream and pinned buffers (None: a CPU lane).
    staging: CudaStaging | None = None
    #: inputs staged ahead for exactly these requests, used as they are.
    staged: Staged | None = None
    #: a decoupled model's response stream (None: one answer per request, with the batch).
    responses: Responses | None = None


@dataclass(slots=True)
class BatchTiming:
    """Nanoseconds spent in each phase, as Triton's compute_input / infer / output."""

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0


@dataclass(slots=True)
class Answered:
    """A response's outputs and the parameters its model set for the client, or the error
    the model answered the request with."""

    outputs: list[Tensor]
    parameters: dict[str, ResponseParameter] = field(default_factory=dict)
    error: SluiceError | None = None


#: a request's outputs (Answered: with its parameters, or the model's own error), or the
#: error of a call that failed.
Answer = list[Tensor] | Answered | SluiceError
#: each request's answer, and the batch's phase timings.
BatchOutputs = tuple[Sequence[Answer], BatchTiming]


@dataclass(frozen=True, slots=True)
class Prompt:
    """A joining sequence as a generative model sees it: the request's own inputs (not
    stacked: prompts differ in length; BYTES as numpy object arrays of bytes) and its
    parameters."""

    inputs: Mapping[str, np.ndarray]
    parameters: Mapping[str, Any]
    #: the request itself (its id, for a model that keeps state per request).
    request: Request


@runtime_checkable
class GenerativeModel(Protocol):
    """sluice's generative contract (docs/models.md; workers/generation/generation.py runs it)."""

    def prefill(self, prompts: Sequence[Prompt]) -> Any: ...

    #: outputs None: the model answered its requests itself
    #: (workers/python_backend/iterative.py).
    def step(self, state: Any) -> tuple[Mapping[str, Any] | None, Sequence[bool]]: ...

    def join(self, state: Any, joining: Any) -> Any: ...

    def keep(self, state: Any, rows: list[int]) -> Any: ...


class ModelInstance(Protocol):
    """One loaded instance of a model, as a lane holds it."""

    @property
    def capabilities(self) -> Capabilities: ...

    def run(self, batch: Batch) -> BatchOutputs:
        """Answer each of the batch's requests (in the lane's thread). Raises only for a
        failure of the whole batch that splitting it may isolate."""
        ...

    def generative_model(self, responses: Responses) -> GenerativeModel | None:
        """The generative contract the in-flight loop steps, its responses going to
        `responses` (None: the instance runs batches)."""
        ...

    def close(self) -> None:
        """Let the instance go (a Triton model's `finalize()` runs once)."""
        ...
