"""Asynchronous jobs as the gateway's operations: submit, look up, cancel, follow.

The storage is gateway/jobs.py; the request is prepared as an infer request is
(gateway/core.py), so a job is refused for exactly what an infer would be.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from sluice.gateway.core import GatewayCore
from sluice.gateway.infer_inputs import InferInput
from sluice.gateway.infer_results import InferOutcome, outcome
from sluice.gateway.jobs import MAX_WAIT_S, Job, JobStore, new_job_id
from sluice.shared import keys
from sluice.shared.errors import Conflict, JobNotFound
from sluice.shared.infer_codec import ParsedInfer, encode_response
from sluice.shared.jobs import request_digest
from sluice.shared.protocol import Request, Result, job_event

#: an event of a job being followed: (name, data), or None while it is still waiting.
JobEvent = tuple[str, dict[str, Any]] | None


@dataclass(frozen=True, slots=True)
class JobState:
    """Where a job stands; model and version once its record is read back."""

    id: str
    status: str
    model: str | None = None
    version: int | None = None


@dataclass(frozen=True, slots=True)
class JobResponses:
    """A decoupled model's finished job: its responses in order, each as its own infer
    response JSON (or `{"error": ...}`)."""

    id: str
    model: str
    version: int
    responses: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": "done",
            "model_name": self.model,
            "model_version": str(self.version),
            "responses": self.responses,
        }


def _state(job_id: str, job: Job | None) -> JobState:
    if job is None:
        return JobState(job_id, "queued")
    return JobState(job_id, job.status, job.meta["model"], job.meta["version"])


class JobOperations:
    def __init__(self, core: GatewayCore, store: JobStore) -> None:
        self.core = core
        self.store = store

    async def submit(self, model: str, version: str | None, infer: InferInput) -> JobState:
        """Queue the request as a job. The client's `id` is an idempotency key: the same id
        with the same request is the job already there, with another request a Conflict."""
        view = await self.core.view(model, version)
        prepared = self.core.prepare(view, version, infer)
        parsed = prepared.request
        job_id = new_job_id(parsed.id)
        request = Request(
            job_id,
            prepared.version,
            time.time_ns(),
            keys.job_stream(job_id),
            parsed.inputs,
            tuple(parsed.outputs) if parsed.outputs else None,
            prepared.parameters,
        )
        meta = {
            "model": view.name,
            "version": prepared.version,
            "client_id": parsed.id,
            "outputs": parsed.outputs,
            "binary": parsed.binary_output,
        }
        digest = request_digest(
            view.name, version or "", parsed.inputs, parsed.parameters, parsed.outputs
        )
        await self.store.submit(request, prepared.route, meta, digest)
        return _state(job_id, await self.store.get(job_id))

    async def get(
        self, job_id: str, wait_s: float = 0.0, gone: asyncio.Future[None] | None = None
    ) -> JobState | InferOutcome | JobResponses:
        """The job's state, or its outcome once done (waiting up to `wait_s` for it, while
        its client is there): a decoupled model's responses, or the one result; a failed job
        raises its error."""
        job = await self.store.get(job_id, min(wait_s, MAX_WAIT_S), gone=gone)
        if job is None:
            raise JobNotFound(f"job '{job_id}' is unknown or expired")
        if job.result is None:
            return _state(job_id, job)
        meta = job.meta
        if job.streamed:
            responses = [_response_json(job, r) for r in job.responses if _shown(r)]
            return JobResponses(job_id, meta["model"], meta["version"], responses)
        parsed = ParsedInfer(meta["client_id"], {}, [], meta["outputs"], meta["binary"])
        return outcome(meta["model"], meta["version"], parsed, job.result)

    async def cancel(self, job_id: str) -> None:
        """Cancel a queued job: JobNotFound if unknown, Conflict if it already finished."""
        job = await self.store.get(job_id)
        redis = self.core.dispatcher.redis
        if job is not None and job.result is None and job.responses:
            # a decoupled model's job under way: its model is told, and ends it
            await redis.publish(keys.cancel_channel(job.meta["model"]), job_id)
            await redis.publish(keys.job_channel(job_id), job_event(job_id, "cancelled"))
            return
        done = await self.store.cancel(job_id)
        if done < 0 or job is None:
            raise JobNotFound(f"job '{job_id}' is unknown or expired")
        if done == 0:
            raise Conflict(f"job '{job_id}' has already finished")
        await redis.publish(keys.cancel_channel(job.meta["model"]), job_id)
        await redis.publish(keys.job_channel(job_id), job_event(job_id, "cancelled"))

    async def events(self, job_id: str) -> AsyncIterator[JobEvent]:
        """The job's status now, then its result (or error) when done, a decoupled model's
        responses each as it comes; JobNotFound at once for an unknown job, before any
        event."""
        job = await self.store.get(job_id)
        if job is None:
            raise JobNotFound(f"job '{job_id}' is unknown or expired")
        return self._follow(job)

    async def _follow(self, job: Job) -> AsyncIterator[JobEvent]:
        job_id = job.id
        current: Job | None = job
        yield ("status", {"id": job_id, "status": job.status})
        sent = 0  # a decoupled model's responses sent as events
        while current is not None:
            for response in current.responses[sent:]:
                if _shown(response):
                    yield ("response", _response_json(current, response))
            sent = len(current.responses)
            if current.result is not None:
                break
            yield None
            current = await self.store.get(job_id, MAX_WAIT_S, more_than=sent)
        if current is None:
            yield ("error", {"id": job_id, "error": "job expired"})
            return
        yield ("status", {"id": job_id, "status": current.status})
        if not current.streamed:
            yield ("result", _result_json(current))


def _shown(response: Result) -> bool:
    """Not a flag-only final response (which says only that the others are all)."""
    return bool(response.outputs) or response.error is not None or not response.final


def _result_json(job: Job) -> dict[str, Any]:
    """A done job's KServe v2 infer response with every output as JSON (an event is text)."""
    assert job.result is not None
    return _response_json(job, job.result)


def _response_json(job: Job, response: Result) -> dict[str, Any]:
    """One answer of the job as a KServe v2 infer response, every output as JSON, or its
    error as `{"error": ...}`."""
    if response.error is not None:
        return {"error": response.error[1]}
    meta = job.meta
    parsed = ParsedInfer(meta["client_id"], {}, [], meta["outputs"], binary_output=False)
    if parsed.outputs:
        parsed.outputs = dict.fromkeys(parsed.outputs, False)
    body, _ = encode_response(
        meta["model"], meta["version"], parsed, response.outputs, response.parameters
    )
    assert isinstance(body, bytes)
    result: dict[str, Any] = orjson.loads(body)
    return result
