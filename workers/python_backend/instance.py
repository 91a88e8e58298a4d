"""One `TritonPythonModel` object serving one instance: a batch's requests in, one answer out
per request.

As in Triton, `execute` gets the requests of a dynamic batch as a list, each with its own
inputs (the model concatenates them itself if it wants to), and must return a list of as many
InferenceResponses. Anything it raises, or a return that breaks that contract, fails every
request of the call with Triton's message and nothing else: the batch is not split to find a
culprit, since the model answers for each request itself. A request's own error answers that
request alone.

An `async def execute` runs on an event loop of the instance's own, on a thread of its own, as
Triton's stub runs it; the calling lane thread waits for it.

A decoupled model's `execute` returns None instead: each request carries a response sender,
which hands the model's responses to the batch's response stream (the queue's ResponseStream,
workers/answers/streamed.py), from `execute` or from any thread after it returned. Its `async def
execute` is not waited for, as in Triton, so the instance takes the next batch while the
coroutine runs.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from sluice.shared.errors import ModelExecutionError, SluiceError
from sluice.shared.protocol import Request
from sluice.workers.instances.model_instance import (
    Answer,
    Answered,
    Batch,
    BatchOutputs,
    BatchTiming,
    Capabilities,
    GenerativeModel,
    Responses,
)
from sluice.workers.python_backend.context import Instance, running
from sluice.workers.python_backend.custom_metrics import release as release_metrics
from sluice.workers.python_backend.errors import to_sluice
from sluice.workers.python_backend.messages import InferenceRequest, InferenceResponse
from sluice.workers.python_backend.sender import InferenceResponseSender
from sluice.workers.python_backend.tensors import to_wire

log = logging.getLogger(__name__)

#: how long `close` waits for an async execute's loop to stop.
LOOP_STOP_TIMEOUT_S = 5.0


class ContractError(Exception):
    """`execute` returned something other than one InferenceResponse per request."""


class TritonInstance:
    """The model object of one instance, with what answering its requests needs."""

    #: `execute` answers each request itself, and may have effects of its own (BLS calls
    #: among them): never split, never on the event loop, never run early.
    capabilities = Capabilities(answers_each=True, may_run_early=False)

    def __init__(
        self,
        name: str,
        model: Any,
        version_dir: Path,
        output_types: dict[str, str],
        owner: Instance | None = None,
    ) -> None:
        self.name = name
        #: what the model's code ran as (context.instance), from its initialize on.
        self.owner = owner if owner is not None else Instance()
        self.model = model
        self.version_dir = version_dir
        #: output name -> wire datatype, from the config (what the client is told).
        self.output_types = output_types
        self._all_outputs = tuple(output_types)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._closed = False

    def run(self, batch: Batch) -> BatchOutputs:
        """`execute` counts as the inference, outputs and all; the batch is handed over once
        its requests are InferenceRequests. Never raises for the model's faults."""
        timing = BatchTiming()
        t0_ns = time.perf_counter_ns()
        handed_ns = t0_ns
        requests, responses = batch.requests, batch.responses
        with running(self.version_dir, self.owner):
            try:
                try:
                    pb_requests = [self.server_request(r, responses) for r in requests]
                finally:
                    handed_ns = time.perf_counter_ns()
                    batch.stacked()
                if responses is not None:
                    self._execute_decoupled(requests, pb_requests, responses)
                    answers: list[Answer] = [[] for _ in requests]  # answered by their senders
                    return answers, _timed(timing, t0_ns, handed_ns)
                returned = self._execute(pb_requests)
            except Exception as exc:  # the model's code, or its return: the call's requests fail
                log.warning("model '%s': execute failed", self.name, exc_info=True)
                error = self._failure(
                    f"{type(exc).__name__}: {exc}"
                    if not isinstance(exc, ContractError)
                    else str(exc)
                )
                return [error for _ in requests], _timed(timing, t0_ns, handed_ns)
        answers = [
            self._answer(r, response) for r, response in zip(requests, returned, strict=True)
        ]
        return answers, _timed(timing, t0_ns, handed_ns)

    def generative_model(self, responses: Responses) -> GenerativeModel | None:
        return None

    def server_request(self, request: Request, responses: Responses | None) -> InferenceRequest:
        """`request` as `execute` gets it, with its response sender to `responses` if
        decoupled."""
        sender = None if responses is None else self._sender(request, responses)
        return InferenceRequest.from_request(request, self._all_outputs, sender)

    def _failure(self, message: str) -> ModelExecutionError:
        return ModelExecutionError(
            f"Failed to process the request(s) for model '{self.name}', message: {message}"
        )

    def _execute(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        returned = self.model.execute(requests)
        if inspect.isawaitable(returned):
            returned = asyncio.run_coroutine_threadsafe(
                _awaited(returned), self._event_loop()
            ).result()
        if not isinstance(returned, list):
            raise ContractError(
                f"Expected a list in the execute return, found type '{type(returned)}'."
            )
        if len(returned) != len(requests):
            raise ContractError(
                "Number of InferenceResponse objects do not match the number of "
                f"InferenceRequest objects. InferenceRequest(s) size is:{len(requests)}, and "
                f"InferenceResponse(s) size is:{len(returned)}"
            )
        for response in returned:
            if not isinstance(response, InferenceResponse):
                raise ContractError(
                    "Expected an 'InferenceResponse' object in the execute function return "
                    f"list, found type '{type(response)}'."
                )
        return returned

    def _sender(self, request: Request, responses: Responses) -> InferenceResponseSender:
        def deliver(response: InferenceResponse | None, final: bool) -> None:
            answer = [] if response is None else self._answer(request, response)
            if isinstance(answer, SluiceError):
                responses.send_tensors(request, [], answer, final)
            elif isinstance(answer, Answered):
                responses.send_tensors(
                    request, answer.outputs, answer.error, final, answer.parameters
                )
            else:
                responses.send_tensors(request, answer, None, final)

        return InferenceResponseSender(deliver, lambda: responses.is_cancelled(request.id))

    def _execute_decoupled(
        self, requests: Sequence[Request], pb: list[InferenceRequest], responses: Responses
    ) -> None:
        """Run a decoupled model's `execute`, which must return None; a coroutine runs on
        the instance's loop without being waited for, its failure ending the requests it
        left open."""
        returned = self.model.execute(pb)
        if inspect.isawaitable(returned):
            running = asyncio.run_coroutine_threadsafe(_awaited(returned), self._event_loop())
            running.add_done_callback(lambda done: self._ended(requests, responses, done))
            return
        if returned is not None:
            raise ContractError(
                f"Python model '{self.name}' is using the decoupled mode and the execute "
                "function must return None."
            )

    def _ended(self, requests: Sequence[Request], responses: Responses, done: Future[Any]) -> None:
        """An `async def execute` of a decoupled model finished: a failure, or a value other
        than None, ends its requests still open with the error, as a raising execute does."""
        exc = done.exception()
        if exc is None and done.result() is None:
            return
        message = (
            f"{type(exc).__name__}: {exc}"
            if exc is not None
            else f"Python model '{self.name}' is using the decoupled mode and the execute "
            "function must return None."
        )
        log.warning("model '%s': execute failed: %s", self.name, message)
        error = self._failure(message)
        for request in requests:
            responses.end(request, error)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop `async def execute` runs on, started on first use."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(
                target=self._loop.run_forever, name=f"{self.name}-async", daemon=True
            )
            self._loop_thread.start()
        return self._loop

    def _answer(self, request: Request, response: InferenceResponse) -> Answer:
        error = response.error()
        if error is not None:
            return Answered([], error=to_sluice(error))
        wanted = self._all_outputs if request.outputs is None else request.outputs
        try:
            outputs = [
                to_wire(tensor, self.output_types[tensor.name()])
                for tensor in response.output_tensors()
                if tensor.name() in wanted and tensor.name() in self.output_types
            ]
        except ValueError as exc:
            return self._failure(str(exc))
        parameters = response.parameter_values
        return Answered(outputs, parameters) if parameters else outputs

    def close(self) -> None:
        """`finalize()` once, when the instance is let go (the worker stops, or an unload)."""
        if self._closed:
            return
        self._closed = True
        finalize = getattr(self.model, "finalize", None)
        try:
            if finalize is not None:
                with running(self.version_dir, self.owner):
                    finalize()
        except Exception:  # the model's code: reported, and the instance goes anyway
            log.exception("model '%s': finalize failed", self.name)
        finally:
            release_metrics(self.owner)
            if self._loop is not None and self._loop_thread is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop_thread.join(LOOP_STOP_TIMEOUT_S)
                if not self._loop_thread.is_alive():
                    self._loop.close()


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _timed(timing: BatchTiming, start_ns: int, handed_ns: int) -> BatchTiming:
    """The hand-over is the input phase; `execute`, to now, the inference."""
    timing.input_ns, timing.infer_ns = handed_ns - start_ns, time.perf_counter_ns() - handed_ns
    return timing
