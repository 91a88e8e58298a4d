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
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sluice.shared.errors import ModelExecutionError, SluiceError
from sluice.shared.protocol import Request
from sluice.shared.protocol import Tensor as WireTensor
from sluice.workers.python_backend.errors import to_sluice
from sluice.workers.python_backend.messages import InferenceRequest, InferenceResponse
from sluice.workers.python_backend.pb_utils import model_dir
from sluice.workers.python_backend.tensors import to_wire

log = logging.getLogger(__name__)

#: how long `close` waits for an async execute's loop to stop.
LOOP_STOP_TIMEOUT_S = 5.0

#: a request's outputs, or the error that answers it.
Answer = list[WireTensor] | SluiceError


class ContractError(Exception):
    """`execute` returned something other than one InferenceResponse per request."""


class TritonInstance:
    """The model object of one instance, with what answering its requests needs."""

    def __init__(
        self, name: str, model: Any, version_dir: Path, output_types: dict[str, str]
    ) -> None:
        self.name = name
        self.model = model
        self.version_dir = version_dir
        #: output name -> wire datatype, from the config (what the client is told).
        self.output_types = output_types
        self._all_outputs = tuple(output_types)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._closed = False

    def run(self, requests: Sequence[Request], stacked: Callable[[], None]) -> list[Answer]:
        """Answer each of `requests`; `stacked` is called once they are handed over as
        InferenceRequests, just before `execute`. Never raises for the model's faults."""
        token = model_dir.set(self.version_dir)
        try:
            try:
                pb_requests = [
                    InferenceRequest.from_request(r, self._all_outputs) for r in requests
                ]
            finally:
                stacked()
            responses = self._execute(pb_requests)
        except Exception as exc:  # the model's code, or its return: the call's requests fail
            log.warning("model '%s': execute failed", self.name, exc_info=True)
            error = self._failure(
                f"{type(exc).__name__}: {exc}" if not isinstance(exc, ContractError) else str(exc)
            )
            return [error for _ in requests]
        finally:
            model_dir.reset(token)
        return [self._answer(r, response) for r, response in zip(requests, responses, strict=True)]

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
            return to_sluice(error)
        wanted = self._all_outputs if request.outputs is None else request.outputs
        try:
            return [
                to_wire(tensor, self.output_types[tensor.name()])
                for tensor in response.output_tensors()
                if tensor.name() in wanted and tensor.name() in self.output_types
            ]
        except ValueError as exc:
            return self._failure(str(exc))

    def close(self) -> None:
        """`finalize()` once, when the instance is let go (the worker stops, or an unload)."""
        if self._closed:
            return
        self._closed = True
        finalize = getattr(self.model, "finalize", None)
        token = model_dir.set(self.version_dir)
        try:
            if finalize is not None:
                finalize()
        except Exception:  # the model's code: reported, and the instance goes anyway
            log.exception("model '%s': finalize failed", self.name)
        finally:
            model_dir.reset(token)
            if self._loop is not None and self._loop_thread is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop_thread.join(LOOP_STOP_TIMEOUT_S)
                if not self._loop_thread.is_alive():
                    self._loop.close()


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
