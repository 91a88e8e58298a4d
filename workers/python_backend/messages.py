"""`pb_utils.InferenceRequest` and `InferenceResponse`.

A request is either made by the server (one per client request in the batch handed to
`execute`) or by the model itself for BLS, where `exec()` / `async_exec()` send it through
the fleet (bls.py) and answer an InferenceResponse, with its error inside, never raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson
from sluice.shared.protocol import Request, ResponseParameter, Result
from sluice.shared.queue_policy import DEADLINE, PRIORITY, TIMEOUT
from sluice.shared.sequence_controls import SEQUENCE_END, SEQUENCE_ID, SEQUENCE_START
from sluice.workers.python_backend import bls
from sluice.workers.python_backend.errors import TritonError, TritonModelException, from_sluice_code
from sluice.workers.python_backend.tensors import Tensor, from_wire, to_wire, wire_name

#: request parameters Triton acts on itself, so that a model's `parameters()` leaves them out.
RESERVED_PARAMETERS = frozenset(
    {SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END, PRIORITY, TIMEOUT, DEADLINE}
)
FLAG_SEQUENCE_START, FLAG_SEQUENCE_END = 1, 2
RELEASE_ALL, RELEASE_RESCHEDULE = 1, 2


def _parameter_values(parameters: dict[str, Any] | str | None) -> dict[str, ResponseParameter]:
    """The parameters a request or response is made with, held to what Triton's parameters
    carry (bool, int, str), with its messages; a JSON string is read first."""
    if parameters is None:
        return {}
    if isinstance(parameters, str):
        try:
            parameters = orjson.loads(parameters)
        except orjson.JSONDecodeError as exc:
            raise TritonModelException(f"parameters are not a JSON object: {exc}") from None
        if not isinstance(parameters, dict):
            raise TritonModelException("parameters are not a JSON object")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(
                f"Expect parameters keys to have type str, found type {type(key)}"
            )
        if not isinstance(value, bool | int | str):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(value)}"
            )
    return parameters


class InferenceResponse:
    """One request's answer: its output tensors, or an error."""

    def __init__(
        self,
        output_tensors: Sequence[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        tensors = list(output_tensors or [])
        for tensor in tensors:
            if not isinstance(tensor, Tensor):
                raise TritonModelException(
                    f"output_tensors must be pb_utils.Tensor objects, got {type(tensor).__name__}"
                )
        if error is not None and not isinstance(error, TritonError):
            raise TritonModelException(f"error must be a pb_utils.TritonError, got {error!r}")
        self._outputs = tensors
        self._error = error
        #: what its client is sent beside the outputs.
        self.parameter_values = _parameter_values(parameters)
        self._parameters = orjson.dumps(self.parameter_values).decode()

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class InferenceTrace:
    """A request's trace, as Triton's `request.trace()`: passed to a BLS request
    (`trace=request.trace()`), the call's spans join the request's trace (OpenTelemetry)."""

    def __init__(self, traceparent: str | None = None) -> None:
        self.traceparent = traceparent

    def get_context(self) -> str | None:
        """The W3C trace context as Triton gives it: JSON with a `traceparent`, or None."""
        if self.traceparent is None:
            return None
        return orjson.dumps({"traceparent": self.traceparent}).decode()


class InferenceRequest:
    """A request: the server's, handed to `execute`, or a model's own for BLS."""

    def __init__(
        self,
        request_id: str = "",
        correlation_id: int | str = 0,
        inputs: Sequence[Tensor] | None = None,
        requested_output_names: Sequence[str] | None = None,
        model_name: str | bytes = "",
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: Any = None,
        trace: Any = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._id = request_id
        self._correlation_id = correlation_id
        self._inputs = list(inputs or [])
        self._outputs = list(requested_output_names or [])
        # Triton's binding takes bytes too: models pass a name read from a BYTES input as is
        self.model_name = model_name.decode() if isinstance(model_name, bytes) else model_name
        self.model_version = model_version
        self._flags = flags
        self._timeout = timeout
        self._parameters = orjson.dumps(_parameter_values(parameters)).decode()
        self._trace = trace if isinstance(trace, InferenceTrace) else InferenceTrace()
        self._sender: Any = None
        #: an iterative model's request may be rescheduled; what its model last asked for.
        self.reschedulable = False
        self.release_flags = RELEASE_ALL

    @classmethod
    def from_request(
        cls, request: Request, all_outputs: Sequence[str], sender: Any = None
    ) -> InferenceRequest:
        """The server's request for one queued request: inputs as views over its bytes;
        `sender` is its response sender (a decoupled model's requests have one)."""
        params = request.parameters
        flags = (FLAG_SEQUENCE_START if params.get(SEQUENCE_START) else 0) | (
            FLAG_SEQUENCE_END if params.get(SEQUENCE_END) else 0
        )
        custom = {k: v for k, v in params.items() if k not in RESERVED_PARAMETERS}
        made = cls(
            request_id=request.id,
            correlation_id=params.get(SEQUENCE_ID, 0),
            inputs=[from_wire(t) for t in request.inputs],
            requested_output_names=request.outputs if request.outputs is not None else all_outputs,
            flags=flags,
            timeout=int(params.get(TIMEOUT, 0)),
        )
        made._parameters = orjson.dumps(custom).decode() if custom else "{}"
        made._sender = sender
        if request.traceparent is not None:
            made._trace = InferenceTrace(request.traceparent)
        return made

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def set_sequence_controls(self, flags: int, controls: Sequence[Tensor]) -> None:
        """What the server says of this request in its sequence: its `flags()`, and the
        config's control inputs (replacing those of its last iteration)."""
        names = {tensor.name() for tensor in controls}
        self._flags = flags
        self._inputs = [t for t in self._inputs if t.name() not in names] + list(controls)

    def request_id(self) -> str:
        return self._id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return self._parameters

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def is_cancelled(self) -> bool:
        """A decoupled model's request: whether its client went away. Otherwise False: a
        request whose client left is dropped before its batch starts."""
        return bool(self._sender is not None and self._sender.is_cancelled())

    def set_release_flags(self, flags: int) -> None:
        """RELEASE_RESCHEDULE keeps an iterative model's request for its next execute
        (workers/python_backend/iterative.py); other models cannot reschedule."""
        if flags != RELEASE_ALL and not self.reschedulable:
            raise TritonModelException("request rescheduling is not supported by sluice")
        self.release_flags = flags

    def get_response_sender(self) -> Any:
        """The request's InferenceResponseSender (decoupled models only, in sluice)."""
        if self._sender is None:
            raise TritonModelException(
                "response senders are for decoupled models (model_transaction_policy "
                "{ decoupled: true }); return one InferenceResponse per request from execute"
            )
        return self._sender

    def trace(self) -> InferenceTrace:
        return self._trace

    # -- BLS ---------------------------------------------------------------------------------

    def _bls_call(self) -> bls.BlsCall:
        if not self.model_name:
            raise TritonModelException("a BLS request needs model_name")
        params: dict[str, Any] = orjson.loads(self._parameters)
        if self._timeout:
            params[TIMEOUT] = self._timeout
        if self._correlation_id:
            params[SEQUENCE_ID] = self._correlation_id
        if self._flags & FLAG_SEQUENCE_START:
            params[SEQUENCE_START] = True
        if self._flags & FLAG_SEQUENCE_END:
            params[SEQUENCE_END] = True
        inputs = [to_wire(t, wire_name(t.triton_dtype())) for t in self._inputs]
        return bls.BlsCall(
            self.model_name,
            max(0, self.model_version),
            inputs,
            tuple(self._outputs) if self._outputs else None,
            params,
            self._timeout / 1e6 if self._timeout else bls.DEFAULT_WAIT_S,
            self._trace.traceparent,
        )

    def exec(self, decoupled: bool = False) -> InferenceResponse | ResponseIterator:
        """Run the request on its model, wherever the fleet serves it, and wait; `decoupled`:
        iterate over its responses as they come."""
        if decoupled:
            return ResponseIterator(bls.submit_streamed(self._bls_call()))
        return response_from_result(bls.submit(self._bls_call()).result())

    async def async_exec(self, decoupled: bool = False) -> InferenceResponse | ResponseIterator:
        """`exec()` as an awaitable, for `async def execute`; a decoupled call's iterator
        comes once every response is in, so that iterating it never blocks the loop."""
        if decoupled:
            streamed = bls.submit_streamed(self._bls_call())
            await asyncio.wrap_future(streamed.finished)
            return ResponseIterator(streamed)
        result = await asyncio.wrap_future(bls.submit(self._bls_call()))
        return response_from_result(result)


class ResponseIterator:
    """Triton's iterator over a decoupled BLS call's responses: each as it arrives, the last
    one flagged final by the target (empty when the target sent the flag alone); a failure is
    one response with its error. Iterated again once finished, it starts over."""

    def __init__(self, streamed: bls.StreamedResults) -> None:
        self._arriving = iter(streamed)
        self._seen: list[InferenceResponse] = []
        self._next = 0
        self._finished = False

    def __iter__(self) -> ResponseIterator:
        if self._finished and self._next >= len(self._seen):
            self._next = 0
        return self

    def __next__(self) -> InferenceResponse:
        if self._next < len(self._seen):
            self._next += 1
            return self._seen[self._next - 1]
        if self._finished:
            raise StopIteration
        result = next(self._arriving)
        self._finished = result.final
        self._seen.append(response_from_result(result))
        self._next = len(self._seen)
        return self._seen[-1]


def response_from_result(result: Result) -> InferenceResponse:
    """A BLS call's result as its caller gets it: outputs and parameters, or the error."""
    if result.error is not None:
        return InferenceResponse(error=from_sluice_code(*result.error))
    return InferenceResponse([from_wire(t) for t in result.outputs], parameters=result.parameters)
