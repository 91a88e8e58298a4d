"""Triton's generate extension: `POST /v2/models/{m}[/versions/{v}]/generate` and
`/generate_stream`, a flat JSON body in, flat JSON responses out.

Every top-level key, and every key inside "parameters", that names a model input becomes
that input's tensor (a scalar or a flat list, fitted into the input's shape as Triton fits it);
the other keys are request parameters. A response is `{"id"?, "model_name", "model_version",
<output>: value, ...}`, an output of one element as a scalar. `/generate` wants exactly one
response; `/generate_stream` sends each as a server-sent event `data: {...}`, an error mid-
stream as `data: {"error": ...}`. Both work for decoupled and ordinary models.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from sluice.gateway.infer_results import StreamedResponse
from sluice.shared.datatypes import element_count
from sluice.shared.errors import InvalidInput, SluiceError
from sluice.shared.http_messages import JSON, HttpResponse, json_response
from sluice.shared.infer_codec import ParsedInfer, decompress, json_data, json_values
from sluice.shared.protocol import Tensor
from sluice.shared.signature import IOSpec, Signature

EVENT_STREAM = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
#: Triton's words when a model answers /generate other than once.
NOT_ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model "
    "that generates various number of responses"
)


@dataclass(slots=True)
class GenerateInfer:
    """A generate request's JSON body, decoded once its model's signature is known."""

    body: bytes
    encoding: str | None = None

    def inflate(self, max_body_bytes: int) -> bytes:
        return decompress(self.body, self.encoding, max_body_bytes)

    def decode(self, body: bytes, sig: Signature) -> ParsedInfer:
        return parse_generate(body, sig)


def parse_generate(body: bytes, sig: Signature) -> ParsedInfer:
    """The generate body as an infer request: input-named keys as tensors, the rest as
    request parameters."""
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"failed to parse the request JSON: {exc}") from None
    if not isinstance(request, dict):
        raise InvalidInput("the request body must be a JSON object")
    request_id = request.pop("id", None)
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string")
    nested = request.pop("parameters", {})
    if not isinstance(nested, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    specs = {spec.name: spec for spec in sig.inputs}
    inputs: dict[str, Tensor] = {}
    parameters: dict[str, Any] = {}
    for key, value in [*request.items(), *nested.items()]:
        spec = specs.get(key)
        if spec is not None:
            if key in inputs:
                raise InvalidInput(f"input '{key}' is given twice")
            inputs[key] = _tensor(sig, spec, value)
        elif isinstance(value, str | int | float | bool):
            parameters[key] = value
        else:
            raise InvalidInput(
                f"parameter '{key}' must be a string, number or boolean (or name a model input)"
            )
    return ParsedInfer(request_id, parameters, list(inputs.values()), None)


def _tensor(sig: Signature, spec: IOSpec, value: Any) -> Tensor:
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, list | dict) for v in values):
        raise InvalidInput(f"input '{spec.name}' must be a value or a flat list of values")
    shape = _fitted(sig.full_shape(spec), len(values), spec.name)
    return Tensor(
        spec.name, spec.datatype, shape, json_data(values, spec.datatype, shape, spec.name)
    )


def _fitted(dims: list[int], count: int, name: str) -> tuple[int, ...]:
    """Triton's fit of `count` elements into `dims`: fixed dims stay, the innermost -1 takes
    what they leave, other -1 dims are 1."""
    shape = [d if d >= 0 else 1 for d in dims]
    variable = [i for i, d in enumerate(dims) if d < 0]
    fixed = element_count(shape)
    if variable and fixed and count % fixed == 0:
        shape[variable[-1]] = count // fixed
    if element_count(shape) != count:
        raise InvalidInput(f"The schema can not convert input '{name}' to tensor with proper shape")
    return tuple(shape)


def response_json(answer: StreamedResponse) -> dict[str, Any]:
    """One response as generate writes it: outputs by name, one element as a scalar."""
    outcome = answer.outcome
    body: dict[str, Any] = {}
    if outcome.request.id is not None:
        body["id"] = outcome.request.id
    body["model_name"] = outcome.model
    body["model_version"] = str(outcome.version)
    for tensor in outcome.outputs:
        values = json_values(tensor)
        flat = values if isinstance(values, list) else values.reshape(-1).tolist()
        body[tensor.name] = flat[0] if len(flat) == 1 else flat
    return body


Answers = AsyncGenerator[StreamedResponse, None]


async def generate(answers: Answers) -> HttpResponse:
    """`/generate` of a request's `answers` (GatewayCore.stream's): the one response, or
    Triton's answers when there is not exactly one (HTTP 200 with the error, as Triton 2.51
    answers) or it is an error (400)."""
    responses = []
    async for answer in answers:
        if answer.error is not None:
            return _error(answer.error, 400)
        if not answer.empty:
            responses.append(answer)
    if len(responses) != 1:
        return json_response({"error": NOT_ONE_RESPONSE})
    return HttpResponse(200, orjson.dumps(response_json(responses[0])), JSON)


async def generate_stream(answers: Answers) -> HttpResponse:
    """`/generate_stream` of a request's `answers`: each response as an event; 400 (events
    still) when the first one is an error, as Triton answers."""
    first = None
    try:
        async for answer in answers:
            if not answer.empty:
                first = answer
                break
    except SluiceError as exc:
        return _error(exc, 400)
    status = 400 if first is not None and first.error is not None else 200
    return HttpResponse(status, headers=EVENT_STREAM, stream=_events(first, answers))


async def _events(
    first: StreamedResponse | None, rest: AsyncGenerator[StreamedResponse, None]
) -> AsyncIterator[bytes]:
    try:
        if first is not None:
            yield _event(first)
            if first.final:
                return
        async for answer in rest:
            if not answer.empty:
                yield _event(answer)
    except SluiceError as exc:  # timed out, cancelled, or Redis away: said in-band
        yield b"data: " + orjson.dumps({"error": exc.message}) + b"\n\n"
    finally:
        await rest.aclose()


def _event(answer: StreamedResponse) -> bytes:
    data = {"error": answer.error.message} if answer.error is not None else response_json(answer)
    return b"data: " + orjson.dumps(data) + b"\n\n"


def _error(error: SluiceError, status: int) -> HttpResponse:
    return HttpResponse(status, orjson.dumps({"error": error.message}), JSON)
