"""What the gateway core answers an infer request with, whatever transport asked: a served
request's outputs, or one response of a streamed one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.shared.errors import SluiceError, error_from_code
from sluice.shared.infer_codec import ParsedInfer
from sluice.shared.protocol import ResponseParameter, Result, Tensor

if TYPE_CHECKING:
    from sluice.gateway.tracing import Trace


@dataclass(slots=True)
class InferOutcome:
    """A served request: the model and version that ran it, what it asked for, its outputs."""

    model: str
    version: int
    request: ParsedInfer
    outputs: Sequence[Tensor]
    #: the response's parameters for the client, as its model set them (None: it set none).
    parameters: dict[str, ResponseParameter] | None = None
    #: a traced request's trace, which its transport ends once the response is made.
    trace: Trace | None = None


def outcome(model: str, version: int, request: ParsedInfer, result: Result) -> InferOutcome:
    """A worker's result as an outcome; the typed error it carries when it failed."""
    if result.error is not None:
        raise error_from_code(*result.error)
    return InferOutcome(model, version, request, result.outputs, result.parameters)


@dataclass(slots=True)
class StreamedResponse:
    """One response of a streamed request: its outputs, or its error, and whether it is the
    request's last. `empty`: a decoupled model's flag-only final response."""

    outcome: InferOutcome
    error: SluiceError | None
    final: bool
    empty: bool = False


def streamed(model: str, version: int, request: ParsedInfer, result: Result) -> StreamedResponse:
    """A worker's result (a streamed response, or an ordinary one) as a StreamedResponse."""
    error = None if result.error is None else error_from_code(*result.error)
    empty = result.seq is not None and not result.outputs and error is None
    done = InferOutcome(model, version, request, result.outputs, result.parameters)
    return StreamedResponse(done, error, result.final, empty)
