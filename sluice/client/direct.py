"""Jobs submitted straight to Redis: no gateway hop, same jobs the gateways serve.

For services that share the Redis: the request goes onto the model's stream exactly as a
gateway would put it, and the job can be read here or through any gateway's `/v2/jobs/{id}`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import msgpack

from sluice.shared import keys
from sluice.shared.admission import enqueue_command, queue_full
from sluice.shared.errors import error_from_code
from sluice.shared.jobs import (
    CANCEL_JOB,
    CREATE_JOB,
    JOB_ID,
    conflict_message,
    request_digest,
)
from sluice.shared.protocol import (
    Request,
    Result,
    Tensor,
    decode_results,
    encode_requests,
    encode_results,
    job_event,
)
from sluice.shared.redis_client import sync_client
from sluice.shared.registry import ModelRecord

from ._wire import Tensorish, TensorKind, array_of, as_kind, raw_tensor
from .errors import (
    Conflict,
    InvalidRequest,
    JobNotFound,
    JobTimeout,
    Unavailable,
    error_for_status,
)

#: one blocking wait, kept below the client's socket timeout; longer waits repeat it.
_BLOCK_S = 5.0
#: the shortest blocking wait (a wait that is due still blocks, as 0 ms would not block).
_MIN_BLOCK_S = 0.001


class RedisClient:
    """Submit and collect jobs through Redis directly (`redis://`, `rediss://`, `unix://`)."""

    def __init__(
        self, redis_url: str, *, job_ttl_s: int = 3600, tensors: TensorKind = "numpy"
    ) -> None:
        self.redis = sync_client(redis_url)
        self.tensors = tensors
        self.job_ttl_s = job_ttl_s

    def submit(
        self,
        model: str,
        inputs: Mapping[str, Tensorish],
        *,
        job_id: str | None = None,
        outputs: list[str] | None = None,
        version: int | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> RedisJob:
        record = self.redis.hget(keys.MODELS, model)
        if record is None:
            raise InvalidRequest(400, f"Request for unknown model: '{model}' is not found")
        info = ModelRecord.decode(record)
        if info.config is None:
            raise InvalidRequest(400, f"model '{model}' is not ready: {info.error}")
        job_id = job_id or uuid.uuid4().hex
        if not JOB_ID.match(job_id):
            raise InvalidRequest(400, "job 'id' must be 1-128 characters of A-Z a-z 0-9 . _ : -")
        params = dict(parameters or {})
        policy = info.config.queue_policy
        level = policy.level_of(params)
        tensors = [Tensor(name, *raw_tensor(value)) for name, value in inputs.items()]
        output_flags = dict.fromkeys(outputs, True) if outputs else None
        digest = request_digest(model, str(version or ""), tensors, params, output_flags)
        version = version or max(info.versions)
        stream = keys.job_stream(job_id)
        request = Request(
            job_id,
            version,
            time.time_ns(),
            stream,
            tensors,
            tuple(outputs) if outputs else None,
            params,
        )
        meta = {
            "model": model,
            "version": version,
            "client_id": job_id,
            "outputs": output_flags,
            "binary": True,
        }
        created = CREATE_JOB.run(
            self.redis, [stream], [msgpack.packb(meta), self.job_ttl_s, digest]
        )
        if created < 0:
            raise Conflict(409, conflict_message(job_id))
        if created:
            self._enqueue(request, model, level, policy.for_level(level).max_queue_size)
        return RedisJob(self, job_id, model)

    def _enqueue(self, request: Request, model: str, level: int, max_queue_size: int) -> None:
        """Queue a new job's request through the gateways' admission; a refused job is removed
        again (503), so that its id can be submitted later."""
        entry = encode_requests([request])
        if max_queue_size:
            command = enqueue_command(model, level, max_queue_size, [entry])
            if not self.redis.execute_command(*command)[0]:
                self.redis.delete(request.reply_to)
                raise Unavailable(503, queue_full(request.id))
        else:
            self.redis.xadd(keys.request_stream(model, level), entry)
        self.redis.publish(keys.job_channel(request.id), job_event(request.id, "queued"))

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> RedisClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisJob:
    def __init__(self, client: RedisClient, job_id: str, model: str) -> None:
        self.client = client
        self.id = job_id
        self.model = model

    def _results(self, block_ms: int = 0) -> list[Result] | None:
        """The job's answers once it finished (None before): its one result, or a decoupled
        model's responses in order, each once, the flag-only final one left out."""
        stream = keys.job_stream(self.id)
        entries = self.client.redis.xrange(stream)
        if not entries:
            raise JobNotFound(404, f"job '{self.id}' is unknown or expired")
        finished = _finished(entries[1:])
        if finished is None and block_ms:
            self.client.redis.xread({stream: entries[-1][0]}, block=block_ms)
            finished = _finished(self.client.redis.xrange(stream)[1:])
        return finished

    def status(self) -> str:
        results = self._results()
        if results is None:
            return "queued"
        return "done" if all(r.error is None for r in results) else "failed"

    def result(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The outputs (a decoupled model's job: its last response's), waited for at most
        `timeout_s` seconds (None: no limit); raises its error."""
        responses = self.responses(timeout_s)
        return responses[-1] if responses else {}

    def responses(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Every response of a decoupled model's job in order, an ordinary job's one, waited
        for at most `timeout_s` seconds (None: no limit); the first error raises."""
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left_s = (
                _BLOCK_S if deadline_s is None else max(_MIN_BLOCK_S, deadline_s - time.monotonic())
            )
            results = self._results(block_ms=int(min(left_s, _BLOCK_S) * 1000))
            if results is not None:
                break
            if deadline_s is not None and time.monotonic() >= deadline_s:
                raise JobTimeout(f"job {self.id} not finished after {timeout_s} s")
        answers = []
        for result in results:
            if result.error is not None:
                error = error_from_code(*result.error)
                raise error_for_status(error.http_status, error.message)
            outputs = {t.name: array_of(t.datatype, t.shape, t.data) for t in result.outputs}
            answers.append(as_kind(outputs, self.client.tensors))
        return answers

    def cancel(self) -> bool:
        fields = encode_results(
            [Result(self.id, error=("CANCELLED", "job was cancelled before it ran"))]
        )
        stream = keys.job_stream(self.id)
        outcome = int(CANCEL_JOB.run(self.client.redis, [stream], [fields["h"], fields["d"]]))
        if outcome < 0:
            raise JobNotFound(404, f"job '{self.id}' is unknown or expired")
        if outcome == 1:
            self.client.redis.publish(keys.cancel_channel(self.model), self.id)
            self.client.redis.publish(keys.job_channel(self.id), job_event(self.id, "cancelled"))
        return outcome == 1


def _finished(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Result] | None:
    """The answers in a job stream's result entries once the job finished, else None."""
    streamed: dict[int, Result] = {}
    last = None
    for _, fields in entries:
        for result in decode_results(fields):
            if result.seq is None:  # one answer (or refused, cancelled): it ends the job
                return [streamed[s] for s in sorted(streamed)] + [result]
            streamed.setdefault(result.seq, result)
            if result.final:
                last = result.seq
    if last is None or not all(s in streamed for s in range(last + 1)):
        return None
    return [
        streamed[s]
        for s in range(last + 1)
        if streamed[s].outputs or streamed[s].error is not None or not streamed[s].final
    ]
