"""The KServe v2 gRPC transport over the gateway core: `inference.GRPCInferenceService`.

Each RPC turns its message into a call of the core (gateway/core.py) and the answer into its
response message, as gateway/app.py does for HTTP; every failure becomes its gRPC status in
`grpc_status`, the one place that knows the mapping (Triton's: src/grpc/grpc_utils.cc).
The messages and the servicer base come generated with the tritonclient wheel.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.json_format import ParseDict, ParseError
from sluice.gateway.bearer import bearer_matches
from sluice.gateway.core import EMPTY_FINAL_RESPONSE, GatewayCore
from sluice.gateway.grpc_codec import (
    GrpcInfer,
    infer_response,
    log_changes,
    log_settings_response,
    parameter_values,
    trace_changes,
    trace_settings_response,
)
from sluice.gateway.infer_results import InferOutcome, StreamedResponse
from sluice.gateway.stream_window import REQUEST_DONE, StreamWindow
from sluice.gateway.tracing import FleetTracing
from sluice.shared.errors import (
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    SluiceError,
    Unauthorized,
    Unsupported,
)
from sluice.shared.log_settings import LogSettingsError
from sluice.shared.redis_client import REDIS_ERRORS, UNWRITTEN, redis_failure
from sluice.shared.trace_settings import TraceSettingsError
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")
#: the parameter of every streamed response: whether it is its request's last.
FINAL_RESPONSE = "triton_final_response"
Status = grpc.StatusCode
#: tritonserver's status for each kind of refused logging update.
LOG_REFUSAL_STATUS = {
    "file": Status.UNIMPLEMENTED,
    "format": Status.INVALID_ARGUMENT,
    "type": Status.INVALID_ARGUMENT,
}

#: a typed error's `code` (shared/errors.py, Triton's names) -> its gRPC status.
STATUS_BY_CODE = {
    "INVALID_ARG": Status.INVALID_ARGUMENT,
    "INVALID_CONFIG": Status.INVALID_ARGUMENT,
    "NOT_FOUND": Status.NOT_FOUND,
    "NOT_FOUND_JOB": Status.NOT_FOUND,
    "NOT_FOUND_ENTITY": Status.NOT_FOUND,
    # Triton: "Request for unknown model: 'm' has no available versions" is NOT_FOUND
    "UNAVAILABLE_MODEL": Status.NOT_FOUND,
    "UNAVAILABLE": Status.UNAVAILABLE,
    # Redis refused a write for memory (shared/errors.py OutOfMemory; HTTP 503)
    "RESOURCE_EXHAUSTED": Status.RESOURCE_EXHAUSTED,
    "CANCELLED": Status.CANCELLED,
    "INTERNAL": Status.INTERNAL,
    "UNKNOWN": Status.UNKNOWN,
    "UNSUPPORTED": Status.UNIMPLEMENTED,
    "ALREADY_EXISTS": Status.ALREADY_EXISTS,
    "UNAUTHENTICATED": Status.UNAUTHENTICATED,
    "DEADLINE_EXCEEDED": Status.DEADLINE_EXCEEDED,
    "FAILED_PRECONDITION": Status.FAILED_PRECONDITION,
}

#: for a code not in the table: its HTTP status says what kind of failure it is.
STATUS_BY_HTTP = {
    400: Status.INVALID_ARGUMENT,
    401: Status.UNAUTHENTICATED,
    404: Status.NOT_FOUND,
    408: Status.DEADLINE_EXCEEDED,
    409: Status.FAILED_PRECONDITION,
    413: Status.RESOURCE_EXHAUSTED,
    501: Status.UNIMPLEMENTED,
    503: Status.UNAVAILABLE,
}


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Any failure of an RPC as its status and message; a bug still answers (INTERNAL)."""
    if isinstance(exc, SluiceError):
        status = STATUS_BY_CODE.get(exc.code) or STATUS_BY_HTTP.get(exc.http_status)
        return status or Status.INTERNAL, exc.message
    if isinstance(exc, REDIS_ERRORS):
        return grpc_status(redis_failure(exc, UNWRITTEN, "Redis is unreachable"))
    log.error("unhandled error in a gRPC call", exc_info=exc)
    return Status.INTERNAL, f"internal error: {exc!r}"


def _version(text: str) -> str | None:
    return text or None


def _traceparent(context: Any, tracing: FleetTracing) -> str | None:
    """The client's trace context, from its metadata (read only when traces follow one)."""
    if context is None or not tracing.follows_context:
        return None
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value if isinstance(value, str) else None
    return None


def _consume(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """`inference.GRPCInferenceService` over one GatewayCore."""

    def __init__(
        self, core: GatewayCore, auth_token: str | None, new_window: Callable[[], StreamWindow]
    ) -> None:
        self.core = core
        #: each ModelStreamInfer stream's bounds.
        self._new_window = new_window
        self._token = None if auth_token is None else auth_token.encode()

    # -- what every RPC goes through ---------------------------------------------------------

    async def _answer(self, context: Any, call: Callable[[], Awaitable[T]]) -> T:
        """`call()` once the caller is authorized; a failure aborts the RPC with its status."""
        try:
            self._authorize(context)
            return await call()
        except Exception as exc:
            await self._abort(context, exc)

    async def _abort(self, context: Any, exc: Exception) -> NoReturn:
        status, message = grpc_status(exc)
        await context.abort(status, message)
        raise AssertionError("context.abort returned")  # it raises; this tells type checkers

    def _authorize(self, context: Any) -> None:
        if self._token is None:
            return
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and bearer_matches(value, self._token):
                return
        raise Unauthorized("missing or invalid bearer token (authorization: Bearer ...)")

    # -- server ------------------------------------------------------------------------------

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.core.ready())

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            return ParseDict(self.core.server_metadata(), pb.ServerMetadataResponse())

        return await self._answer(context, call)

    # -- models ------------------------------------------------------------------------------

    async def ModelReady(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            try:
                await self.core.model_ready(request.name, _version(request.version))
            except (ModelNotReady, ModelNotFound):
                return pb.ModelReadyResponse(ready=False)
            return pb.ModelReadyResponse(ready=True)

        return await self._answer(context, call)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            meta = await self.core.model_metadata(request.name, _version(request.version))
            return ParseDict(meta, pb.ModelMetadataResponse())

        return await self._answer(context, call)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            config = await self.core.model_config(request.name, _version(request.version))
            return pb.ModelConfigResponse(config=_model_config(request.name, config))

        return await self._answer(context, call)

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            name = request.name or None
            stats = await self.core.statistics(name, _version(request.version) if name else None)
            return ParseDict(stats, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

        return await self._answer(context, call)

    # -- repository --------------------------------------------------------------------------

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            index = await self.core.repository.index(ready_only=request.ready)
            entry = pb.RepositoryIndexResponse.ModelIndex
            models = [
                entry(
                    name=item["name"],
                    version=item.get("version") or "",
                    state=item.get("state") or "",
                    reason=item.get("reason") or "",
                )
                for item in index
            ]
            return pb.RepositoryIndexResponse(models=models)

        return await self._answer(context, call)

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            params = parameter_values(request.parameters)
            config = params.pop("config", None)
            if config is not None and not isinstance(config, str):
                raise InvalidInput("parameter 'config' must be a string (string_param)")
            files = {}
            for key, value in params.items():
                if key.startswith("file:"):
                    if not isinstance(value, bytes):
                        raise InvalidInput(f"parameter '{key}' must be bytes (bytes_param)")
                    files[key.removeprefix("file:")] = value
            await self.core.repository.load_model(request.model_name, config, files or None)
            return pb.RepositoryModelLoadResponse()

        return await self._answer(context, call)

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            dependents = parameter_values(request.parameters).get("unload_dependents", False)
            if not isinstance(dependents, bool):
                raise InvalidInput("parameter 'unload_dependents' must be a bool (bool_param)")
            await self.core.repository.unload_model(
                request.model_name, unload_dependents=dependents
            )
            return pb.RepositoryModelUnloadResponse()

        return await self._answer(context, call)

    # -- infer -------------------------------------------------------------------------------

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        try:
            self._authorize(context)
            outcome = await self._infer(request, context)
        except Exception as exc:
            await self._abort(context, exc)
        response = infer_response(outcome)
        if outcome.trace is not None:
            self.core.tracing.responded(outcome.trace, time.time_ns())
        return response

    async def _infer(self, request: Any, context: Any) -> InferOutcome:
        outcome = await self._run(request, _traceparent(context, self.core.tracing))
        self.core.shared_memory.write_outputs(outcome.request.shm_outputs, outcome.outputs)
        return outcome

    async def _run(self, request: Any, traceparent: str | None = None) -> InferOutcome:
        """Run one request; the RPC cancelled (client gone, deadline passed) cancels it in
        the queue, as a closed HTTP connection does. The core runs in a task of its own so
        that grpc's cancellation reaches it as `gone` rather than as CancelledError (grpc
        cancels the handler before it runs the context's done callbacks, too late for that)."""
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()
        infer = self.core.infer(
            request.model_name,
            _version(request.model_version),
            GrpcInfer(request, self.core.shared_memory.read),
            gone,
            "ModelInfer RPC",
            traceparent,
        )
        task = loop.create_task(infer)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not gone.done():
                gone.set_result(None)
            task.add_done_callback(_consume)
            raise

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:
        """Every response of every request, each sent as soon as it is done (the request id
        says which; a decoupled model's in its order); a failure answers in-band with
        `error_message`, and the stream goes on. The stream's window (gateway/stream_window.py)
        bounds what it holds for a client that sends without reading."""
        try:
            self._authorize(context)
        except SluiceError as exc:
            await self._abort(context, exc)
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()
        window = self._new_window()
        context_trace = _traceparent(context, self.core.tracing)
        reading = self._read_stream(request_iterator, gone, window, context_trace)
        reader = asyncio.ensure_future(reading)
        try:
            while (response := await window.get()) is not None:
                if response is REQUEST_DONE:
                    window.leave()
                else:
                    yield response
        finally:
            if not gone.done():
                gone.set_result(None)  # cancels whatever is still queued
            reader.cancel()
            window.close()

    async def _read_stream(
        self,
        request_iterator: Any,
        gone: asyncio.Future[None],
        window: StreamWindow,
        traceparent: str | None,
    ) -> None:
        """Start each request as it arrives while the window has room for it, else stop
        reading; once the client is done sending and every request is answered, end the
        stream. The stream's trace context (its metadata's) is each request's."""
        running: set[asyncio.Task[None]] = set()
        requests = aiter(request_iterator)
        try:
            while True:
                await window.admit()
                request = await anext(requests, None)
                if request is None:
                    window.leave()
                    break
                # checked here, in the stream's order, so that the requests are queued in it
                # (each task queues its own as it starts, and tasks start in order)
                try:
                    answers: AsyncGenerator[Any, None] | Exception = await self.core.stream(
                        request.model_name,
                        _version(request.model_version),
                        GrpcInfer(request, self.core.shared_memory.read),
                        gone,
                        traceparent,
                    )
                except Exception as exc:
                    answers = exc
                task = asyncio.ensure_future(self._stream_one(request, answers, window))
                running.add(task)
                task.add_done_callback(running.discard)
            if running:
                await asyncio.wait(running)
        except Exception as exc:  # the stream broke while reading; nothing more to answer
            log.debug("gRPC stream ended while reading: %r", exc)
        finally:
            for task in running:
                task.cancel()
            window.end()

    async def _stream_one(
        self, request: Any, answers: AsyncGenerator[Any, None] | Exception, window: StreamWindow
    ) -> None:
        """Every response of one request, in order, each with `triton_final_response`; a
        decoupled model's flag-only final one only if the request asked for it with
        `triton_enable_empty_final_response`. An error answers in-band. A response waits
        while the client's queue is full, and so do the request's later ones."""
        empty_final = parameter_values(request.parameters).get(EMPTY_FINAL_RESPONSE) is True
        try:
            if isinstance(answers, Exception):
                raise answers
            async with aclosing(answers):
                async for answer in answers:
                    if answer.empty and not empty_final:
                        continue
                    if answer.error is None and not answer.empty:
                        outcome = answer.outcome
                        spans = outcome.request.shm_outputs
                        self.core.shared_memory.write_outputs(spans, outcome.outputs)
                    response = _streamed_response(request, answer)
                    await window.put(response, response.ByteSize())
        except Exception as exc:
            _, message = grpc_status(exc)
            failed = pb.ModelInferResponse(
                model_name=request.model_name, model_version=request.model_version, id=request.id
            )
            response = pb.ModelStreamInferResponse(error_message=message, infer_response=failed)
            await window.put(response, response.ByteSize())
        window.done()

    # -- shared memory -----------------------------------------------------------------------

    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            response = pb.SystemSharedMemoryStatusResponse()
            for region in self.core.shared_memory.status(request.name or None):
                entry = response.regions[region["name"]]
                entry.name, entry.key = region["name"], region["key"]
                entry.offset, entry.byte_size = region["offset"], region["byte_size"]
            return response

        return await self._answer(context, call)

    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            self.core.shared_memory.register(
                request.name, request.key, request.offset, request.byte_size
            )
            return pb.SystemSharedMemoryRegisterResponse()

        return await self._answer(context, call)

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            self.core.shared_memory.unregister(request.name or None)
            return pb.SystemSharedMemoryUnregisterResponse()

        return await self._answer(context, call)

    # -- CUDA shared memory: no GPU at the gateway, answered as Triton without CUDA ----------

    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        return await self._answer(context, _no_regions(pb.CudaSharedMemoryStatusResponse))

    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        await self._abort(
            context,
            InvalidInput(
                f"failed to register CUDA shared memory region: '{request.name}', GPUs not "
                "supported"
            ),
        )

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        return await self._answer(context, _no_regions(pb.CudaSharedMemoryUnregisterResponse))

    async def TraceSetting(self, request: Any, context: Any) -> Any:
        async def call() -> Any:
            model = request.model_name or None
            if model is not None:
                self.core.known_model(model)
            tracing = self.core.tracing
            if not request.settings:
                await tracing.refresh()
                return trace_settings_response(tracing.settings(model))
            try:
                changed = await tracing.update(model, trace_changes(request))
            except TraceSettingsError as exc:
                refusal = Unsupported if exc.status == 501 else InvalidInput
                raise refusal(str(exc)) from None
            return trace_settings_response(changed)

        return await self._answer(context, call)

    async def LogSettings(self, request: Any, context: Any) -> Any:
        async def call() -> tuple[Any, LogSettingsError | None]:
            return await self.core.logging.update(log_changes(request))

        settings, refused = await self._answer(context, call)
        if refused is not None:
            # tritonserver's gRPC words: "log_format", where HTTP says "--log_format"
            message = str(refused).replace("--log_format", "log_format")
            await context.abort(LOG_REFUSAL_STATUS[refused.kind], message)
        return log_settings_response(settings)


def _streamed_response(request: Any, answer: StreamedResponse) -> Any:
    """One streamed response as its message: outputs, or the error in-band."""
    if answer.error is None and not answer.empty:
        response = infer_response(answer.outcome)
        message = ""
    else:
        response = pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        )
        message = "" if answer.error is None else grpc_status(answer.error)[1]
    response.parameters[FINAL_RESPONSE].bool_param = answer.final
    return pb.ModelStreamInferResponse(error_message=message, infer_response=response)


def _no_regions(response: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    """No region is ever registered: status lists none, unregistering has nothing to do."""

    async def call() -> Any:
        return response()

    return call


def _model_config(name: str, config: dict[str, Any]) -> Any:
    """The config JSON the model table holds (Triton's own JSON form) as the proto message."""
    try:
        return ParseDict(config, mc.ModelConfig(), ignore_unknown_fields=True)
    except ParseError as exc:
        raise SluiceError(f"model '{name}': its config does not fit ModelConfig: {exc}") from None
