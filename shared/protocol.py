"""The wire format between gateways and workers.

A stream entry holds one or more requests (a gateway coalesces the requests that arrive in
the same event-loop turn) as two fields:

* ``h``: a msgpack header, ``[SCHEMA, [request, ...]]`` where a request is
  ``[id, version, enqueue_ns, reply_to, [[name, datatype, shape, nbytes], ...], outputs, params]``;
* ``d``: the raw tensor bytes of every input, concatenated in header order.

An ensemble step's request carries its continuation as the parameter ``sluice_ensemble``, and
the client inputs later steps need after its own inputs, counted by ``sluice_carried``.

Reply entries mirror it: ``[SCHEMA, [[id, [[name, datatype, shape, nbytes], ...], error], ...]]``
plus the concatenated output bytes. A response of a decoupled model's request (one of zero or
more) appends its sequence number and final flag to its item, ``[id, tensors, error, seq,
final]``; an ordinary request's item stays three long, so its cost is unchanged. A response
that carries parameters (a Triton Python model's `InferenceResponse(parameters=...)`) appends
them as a map last: ``[id, tensors, error, params]`` or ``[id, tensors, error, seq, final,
params]``.

Tensors are never inside msgpack, so decoding is ``np.frombuffer`` over the blob: zero copies,
and nothing read off the wire can run code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import orjson
from sluice.shared.datatypes import ELEMENT_SIZE, element_count

SCHEMA = 1
#: the request parameter that carries an ensemble step's continuation.
CONTINUATION = "sluice_ensemble"
#: the request parameter that counts the tensors after its inputs carried for later steps.
CARRIED = "sluice_carried"
#: a request sampled for a trace (Triton's trace extension): the worker sends its batch's
#: compute timestamps back with the result, under the same name among the result's parameters.
#: Its value is true, or in OpenTelemetry mode [traceparent, opens a model span].
TRACED = "sluice_trace"
#: the longest traceparent taken from an entry (a W3C version-00 one is 55 characters).
MAX_TRACEPARENT = 128

#: caps on what a header may declare, so a hostile entry cannot make the decoder allocate.
MAX_HEADER_BYTES = 1 << 20
_UNPACK_LIMITS: dict[str, Any] = {
    "max_str_len": 1 << 16,
    "max_bin_len": 0,
    "max_array_len": 1 << 16,
    "max_map_len": 1 << 10,
    "max_ext_len": 0,
}

Buffer = bytes | bytearray | memoryview
#: the value of a response parameter: what Triton's responses carry (bool, int64, string).
ResponseParameter = bool | int | str
#: a stream entry's fields as redis-py parses them, or as RESP sends them (name, value, ...).
Fields = dict[bytes, bytes] | list[bytes]


class ProtocolError(ValueError):
    """An entry that does not follow the wire format."""


@dataclass(slots=True)
class Tensor:
    """Raw row-major little-endian bytes (BYTES: length-prefixed elements) plus type and shape."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: Buffer


@dataclass(slots=True)
class Request:
    id: str
    version: int
    enqueue_ns: int
    reply_to: str
    inputs: list[Tensor]
    outputs: tuple[str, ...] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    #: an ensemble step's continuation (sluice.shared.ensemble_wire), carried on the wire as
    #: the parameter CONTINUATION and never among the parameters a model sees.
    continuation: list[Any] | None = None
    #: an ensemble step's client inputs that later steps need: on the wire after `inputs`,
    #: counted by the parameter CARRIED, never among the inputs a model sees.
    carried: list[Tensor] = field(default_factory=list)
    #: sampled for a trace: on the wire as the parameter TRACED, never among those a model sees.
    traced: bool = False
    #: an OpenTelemetry trace's W3C traceparent: the span the worker's spans go under.
    traceparent: str | None = None
    #: the worker opens a span named after its model under `traceparent`, as no gateway did
    #: (an ensemble step's, a BLS call's); otherwise the gateway's model span is the parent.
    model_span: bool = False


@dataclass(slots=True)
class Result:
    id: str
    outputs: list[Tensor] = field(default_factory=list)
    #: (error code, message) when the request failed; see sluice.shared.errors.
    error: tuple[str, str] | None = None
    #: a decoupled request's response: its number, 0 up, in the order the model sent it
    #: (None: the one answer of an ordinary request, or a request refused before it ran).
    seq: int | None = None
    #: the last response of its request (always so for an ordinary one).
    final: bool = True
    #: the response's parameters for its client (bool, int or str values), if it has any.
    parameters: dict[str, ResponseParameter] | None = None
    #: `error` is the model's own answer to the request (a Triton Python model's
    #: `InferenceResponse(error=...)`), which Triton's statistics count as a success; it
    #: stays with the worker, never on the wire.
    answered_by_model: bool = False
    #: a traced request's compute timestamps (wall-clock ns): COMPUTE_START,
    #: COMPUTE_INPUT_END, COMPUTE_OUTPUT_START, COMPUTE_END; on the wire among the parameters
    #: as TRACED, never shown to the client.
    timestamps: list[int] | None = None


def _tensor_headers(tensors: Iterable[Tensor], blobs: list[Buffer]) -> list[list[Any]]:
    heads = []
    for t in tensors:
        data = t.data
        nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
        heads.append([t.name, t.datatype, list(t.shape), nbytes])
        blobs.append(data)
    return heads


#: what msgpack raises for a value it cannot carry (an integer past 64 bits, an odd type).
ENCODING_ERRORS = (TypeError, ValueError, OverflowError)


def encoding_problem(request: Request) -> str | None:
    """Why `request` cannot be put on a stream, naming the parameter at fault (None: it can).
    Parameters come from the wire: JSON's integers have no bound, msgpack's have 64 bits."""
    try:
        encode_requests([request])
    except ENCODING_ERRORS as exc:
        for name, value in request.parameters.items():
            try:
                msgpack.packb(value)
            except ENCODING_ERRORS as error:
                return f"parameter '{name}' cannot be queued: {error}"
        return f"the request cannot be queued: {exc}"
    return None


def encode_requests(requests: Sequence[Request]) -> dict[str, bytes]:
    """Fields of one stream entry carrying `requests`."""
    blobs: list[Buffer] = []
    items = [
        [
            r.id,
            r.version,
            r.enqueue_ns,
            r.reply_to,
            _tensor_headers([*r.inputs, *r.carried], blobs),
            list(r.outputs) if r.outputs is not None else None,
            _parameters(r),
        ]
        for r in requests
    ]
    return {"h": msgpack.packb([SCHEMA, items]), "d": b"".join(blobs)}


def _parameters(request: Request) -> dict[str, Any]:
    if request.continuation is None and not request.traced:
        return request.parameters
    extra: dict[str, Any] = {}
    if request.continuation is not None:
        extra[CONTINUATION] = request.continuation
    if request.carried:
        extra[CARRIED] = len(request.carried)
    if request.traced:
        tp = request.traceparent
        extra[TRACED] = True if tp is None else [tp, request.model_span]
    return {**request.parameters, **extra}


def encode_results(results: Sequence[Result]) -> dict[str, bytes]:
    """Fields of one reply entry carrying `results` for a single gateway."""
    blobs: list[Buffer] = []
    items = []
    for r in results:
        item: list[Any] = [r.id, _tensor_headers(r.outputs, blobs), r.error]
        if r.seq is not None:
            item += [r.seq, r.final]
        if r.timestamps is not None:
            item.append({**(r.parameters or {}), TRACED: r.timestamps})
        elif r.parameters:
            item.append(r.parameters)
        items.append(item)
    return {"h": msgpack.packb([SCHEMA, items]), "d": b"".join(blobs)}


def _unpack_header(fields: Fields) -> tuple[list[Any], memoryview]:
    if isinstance(fields, list):
        pairs = iter(fields)
        fields = dict(zip(pairs, pairs, strict=False))
    try:
        header, blob = fields[b"h"], fields[b"d"]
    except KeyError as exc:
        raise ProtocolError(f"entry lacks field {exc.args[0]!r}") from None
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError("entry header too large")
    try:
        decoded = msgpack.unpackb(header, **_UNPACK_LIMITS)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"undecodable header: {exc}") from None
    if not (isinstance(decoded, list) and len(decoded) == 2 and decoded[0] == SCHEMA):
        raise ProtocolError("unknown header schema")
    if not isinstance(decoded[1], list):
        raise ProtocolError("header items are not a list")
    return decoded[1], memoryview(blob)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cut_tensors(heads: Any, blob: memoryview, offset: int) -> tuple[list[Tensor], int]:
    if not isinstance(heads, list):
        raise ProtocolError("tensor list is not a list")
    tensors = []
    for head in heads:
        if not (isinstance(head, list) and len(head) == 4):
            raise ProtocolError("malformed tensor header")
        name, datatype, shape, nbytes = head
        if not (isinstance(name, str) and isinstance(datatype, str) and datatype in ELEMENT_SIZE):
            raise ProtocolError(f"bad name or datatype in tensor header {name!r}")
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
            raise ProtocolError(f"tensor {name!r}: shape must be non-negative integers")
        if not (_is_int(nbytes) and nbytes >= 0):
            raise ProtocolError(f"tensor {name!r}: nbytes must be a non-negative integer")
        size = ELEMENT_SIZE[datatype]
        if size and element_count(shape) * size != nbytes:
            raise ProtocolError(f"tensor {name!r}: {nbytes} bytes do not fit shape {shape}")
        if offset + nbytes > len(blob):
            raise ProtocolError(f"tensor {name!r} runs past the end of the entry")
        tensors.append(Tensor(name, datatype, tuple(shape), blob[offset : offset + nbytes]))
        offset += nbytes
    return tensors, offset


def _names(value: Any, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ProtocolError(f"{what} must be a list of strings")
    return tuple(value)


def decode_requests(fields: Fields) -> list[Request]:
    """Requests of one stream entry; tensor data are views into the entry's blob."""
    items, blob = _unpack_header(fields)
    requests, offset = [], 0
    for item in items:
        if not (isinstance(item, list) and len(item) == 7):
            raise ProtocolError("malformed request header")
        rid, version, enqueue_ns, reply_to, heads, outputs, params = item
        if not (
            isinstance(rid, str)
            and isinstance(reply_to, str)
            and isinstance(params, dict)
            and _is_int(version)
            and _is_int(enqueue_ns)
        ):
            raise ProtocolError("malformed request header")
        inputs, offset = _cut_tensors(heads, blob, offset)
        continuation = params.pop(CONTINUATION, None)
        if continuation is not None and not isinstance(continuation, list):
            raise ProtocolError("an ensemble continuation must be a list")
        carried = params.pop(CARRIED, 0)
        if not (_is_int(carried) and 0 <= carried <= len(inputs)):
            raise ProtocolError("carried tensors must be a count of the request's tensors")
        kept = inputs[len(inputs) - carried :]
        del inputs[len(inputs) - carried :]
        traced, traceparent, model_span = _trace(params.pop(TRACED, False))
        requests.append(
            Request(
                rid,
                version,
                enqueue_ns,
                reply_to,
                inputs,
                _names(outputs, "outputs"),
                params,
                continuation,
                kept,
                traced,
                traceparent,
                model_span,
            )
        )
    return requests


def _trace(value: Any) -> tuple[bool, str | None, bool]:
    """A request's TRACED parameter: traced, its traceparent, whether it opens a model span."""
    if value is True:
        return True, None, False
    if (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and len(value[0]) <= MAX_TRACEPARENT
    ):
        return True, value[0], value[1] is True
    return False, None, False


def decode_results(fields: Fields) -> list[Result]:
    """Results of one reply entry; output data are views into the entry's blob."""
    items, blob = _unpack_header(fields)
    results, offset = [], 0
    for item in items:
        if not (isinstance(item, list) and isinstance(item[0] if item else None, str)):
            raise ProtocolError("malformed result header")
        parameters, timestamps = None, None
        if len(item) in (4, 6):
            given = item.pop()
            timestamps = given.pop(TRACED, None) if isinstance(given, dict) else None
            if timestamps is not None and not (
                isinstance(timestamps, list)
                and len(timestamps) == 4
                and all(map(_is_int, timestamps))
            ):
                raise ProtocolError("a result's trace must be four timestamps")
            parameters = _response_parameters(given) if given or timestamps is None else None
        streamed = len(item) == 5
        if streamed:
            rid, heads, error, seq, final = item
            if not (_is_int(seq) and seq >= 0 and isinstance(final, bool)):
                raise ProtocolError("a streamed response needs a sequence number and a final flag")
        elif len(item) == 3:
            rid, heads, error = item
        else:
            raise ProtocolError("malformed result header")
        if error is not None and not (
            isinstance(error, list) and len(error) == 2 and all(isinstance(e, str) for e in error)
        ):
            raise ProtocolError("result error must be [code, message]")
        outputs, offset = _cut_tensors(heads, blob, offset)
        failure = (error[0], error[1]) if error else None
        results.append(
            Result(rid, outputs, failure, seq, final, parameters, timestamps=timestamps)
            if streamed
            else Result(rid, outputs, failure, parameters=parameters, timestamps=timestamps)
        )
    return results


def _response_parameters(value: Any) -> dict[str, ResponseParameter]:
    if not (
        isinstance(value, dict)
        and all(isinstance(k, str) and isinstance(v, bool | int | str) for k, v in value.items())
    ):
        raise ProtocolError("response parameters must map names to bool, int or str")
    return value


def job_event(job_id: str, status: str) -> bytes:
    """What a job's pub/sub channel carries: JSON `{"id", "status"}`."""
    return orjson.dumps({"id": job_id, "status": status})


def settle_results(
    fields: Fields,
    waiting: Mapping[str, asyncio.Future[Result]],
    streamed: Callable[[Result], None] | None = None,
) -> None:
    """Hand a reply entry's results to the futures waiting on their ids (ProtocolError if the
    entry does not decode); a result nobody waits for any more is dropped. A decoupled
    request's responses go to `streamed` instead (dropped without one)."""
    for result in decode_results(fields):
        if result.seq is not None:
            if streamed is not None:
                streamed(result)
            continue
        future = waiting.get(result.id)
        if future is not None and not future.done():
            future.set_result(result)
