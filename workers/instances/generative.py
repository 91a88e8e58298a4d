"""The instance of a generative model: its sequences are stepped by the in-flight loop
(workers/generation/inflight_loop.py), never run as a batch."""

from __future__ import annotations

from collections.abc import Callable

from sluice.shared.errors import ModelExecutionError
from sluice.workers.instances.model_instance import (
    Batch,
    BatchOutputs,
    BatchTiming,
    Capabilities,
    GenerativeModel,
    Responses,
)


class GenerativeInstance:
    """A generative model as a lane holds it."""

    #: it streams each request's responses itself, and a run has effects: the state.
    capabilities = Capabilities(answers_each=True, may_run_early=False, generative=True)

    def __init__(
        self,
        model_for: Callable[[Responses], GenerativeModel],
        close: Callable[[], None],
        name: str,
    ) -> None:
        """`model_for(responses)`: the model, its responses going to `responses`;
        `close`: lets it go (a Triton Python model's `finalize()`)."""
        self._model_for = model_for
        self._close = close
        self._name = name

    def run(self, batch: Batch) -> BatchOutputs:
        """A batch is not how a generative model runs: each request gets the error."""
        error = ModelExecutionError(
            f"model '{self._name}': a generative model runs only through its in-flight loop"
        )
        return [error for _ in batch.requests], BatchTiming()

    def generative_model(self, responses: Responses) -> GenerativeModel:
        return self._model_for(responses)

    def close(self) -> None:
        self._close()
