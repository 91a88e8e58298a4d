"""Asynchronous jobs: submit now, collect later from any gateway, even after disconnecting.

A job is one Redis stream, `sluice:{job:<id>}`, created with a metadata entry and a TTL. The
request goes to the model's queue like any other, with that stream as its reply route, so
workers need nothing new: they append the result entry. Reading the job is an XRANGE;
waiting for it waits for its announcement (gateway/job_watch.py), then reads it again. A
decoupled model's job gets one entry per response; it is done with the final one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT
from sluice.gateway.job_watch import JobWatch
from sluice.gateway.outage import RETRY_AFTER_S
from sluice.gateway.outbox import Route
from sluice.gateway.response_order import ResponseOrder
from sluice.shared import keys
from sluice.shared.admission import enqueue_command, queue_full
from sluice.shared.errors import Conflict, InvalidInput, Unavailable
from sluice.shared.jobs import (
    CANCEL_JOB,
    CREATE_JOB,
    HOLD_QUOTA,
    JOB_ID,
    MAX_JOBS,
    conflict_message,
    quota_message,
)
from sluice.shared.protocol import (
    Request,
    Result,
    decode_results,
    encode_requests,
    encode_results,
    job_event,
)
from sluice.shared.redis_client import REDIS_ERRORS, out_of_memory, redis_failure

MAX_WAIT_S = 60.0
#: a job stream's entries as XRANGE gives them (replies are never decoded)
Entries = list[tuple[bytes, dict[bytes, bytes]]]


def new_job_id(client_id: str | None) -> str:
    """The client's id is the idempotency key; without one, a fresh id."""
    if client_id is None:
        return uuid.uuid4().hex
    if not JOB_ID.match(client_id):
        raise InvalidInput("job 'id' must be 1-128 characters of A-Z a-z 0-9 . _ : -")
    return client_id


@dataclass(slots=True)
class Job:
    id: str
    meta: dict[str, Any]
    #: the answer that ended the job (a decoupled model's final response), None until then.
    result: Result | None
    #: a decoupled model's responses so far, in order, each once (the final one included).
    responses: list[Result] = field(default_factory=list)

    @property
    def status(self) -> str:
        if self.result is None:
            return "running" if self.responses else "queued"
        return "done" if self.result.error is None else "failed"

    @property
    def streamed(self) -> bool:
        """Answered by a decoupled model's responses (not one result, nor refused at once)."""
        return bool(self.responses) and (self.result is None or self.result.seq is not None)


def read_job(job_id: str, entries: Entries) -> Job | None:
    """The job from its stream's entries: the metadata, then one result, or a decoupled
    model's responses (put in order, each once, as a gateway delivers them)."""
    if not entries or b"m" not in entries[0][1]:
        return None
    meta = msgpack.unpackb(entries[0][1][b"m"])
    order = ResponseOrder()
    for _, fields in entries[1:]:
        for result in decode_results(fields):
            if result.seq is None:  # one answer (or refused, cancelled): it ends the job
                return Job(job_id, meta, result, list(order.ready))
            order.receive(result)
    responses = list(order.ready)
    return Job(job_id, meta, responses[-1] if order.finished else None, responses)


class JobStore:
    def __init__(
        self, redis: aioredis.Redis, watch: JobWatch, ttl_s: int, max_jobs: int = MAX_JOBS
    ) -> None:
        self.redis = redis
        self.watch = watch
        self.ttl_s = ttl_s
        #: jobs kept fleet-wide at most (0: no limit), each until its TTL ends.
        self.max_jobs = max_jobs

    async def submit(
        self, request: Request, route: Route, meta: dict[str, Any], digest: str
    ) -> bool:
        """Create the job and queue its request; False if the job already existed for the same
        request (`digest`), Conflict if for another one.

        A job counts against `max_jobs` until it expires (Unavailable past it). A level with a
        `max_queue_size` admits the job as it admits an infer request; a job it refuses, or
        whose request Redis refused for memory, is removed again (and no longer counted), so
        that the same id can be submitted later.
        """
        created = counted = 0
        try:
            counted = await HOLD_QUOTA.run(
                self.redis, [keys.JOBS_KEPT], [request.id, self.ttl_s, self.max_jobs]
            )
            if not counted:
                raise Unavailable(quota_message("jobs", self.max_jobs, "--max-jobs"))
            created = await CREATE_JOB.run(
                self.redis, [request.reply_to], [msgpack.packb(meta), self.ttl_s, digest]
            )
            if created != 1:
                await self._uncount(counted, request.id)
                if created < 0:
                    raise Conflict(conflict_message(request.id))
                return False
            entry = encode_requests([request])
            if route.max_queue_size:
                command = enqueue_command(route.model, route.level, route.max_queue_size, [entry])
                (admitted,) = await self.redis.execute_command(*command)
                if not admitted:
                    await self.redis.delete(request.reply_to)
                    await self._uncount(counted, request.id)
                    raise Unavailable(queue_full(request.id))
            else:
                stream = keys.request_stream(route.model, route.level)
                await self.redis.xadd(stream, cast("dict[FieldT, EncodableT]", entry))
            await self.redis.publish(keys.job_channel(request.id), job_event(request.id, "queued"))
        except REDIS_ERRORS as exc:
            if out_of_memory(exc):  # take back what this call wrote: DEL and ZREM pass a full Redis
                with contextlib.suppress(*REDIS_ERRORS):
                    if created == 1:
                        await self.redis.delete(request.reply_to)
                    await self._uncount(counted, request.id)
            raise redis_failure(
                exc, "job not created", "queue unavailable", RETRY_AFTER_S
            ) from None
        return True

    async def _uncount(self, counted: int, job_id: str) -> None:
        """Take back the count of a job this call counted (1) but did not create."""
        if counted == 1:
            await self.redis.zrem(keys.JOBS_KEPT, job_id)

    async def get(
        self,
        job_id: str,
        wait_s: float = 0.0,
        more_than: int | None = None,
        gone: asyncio.Future[None] | None = None,
    ) -> Job | None:
        """The job; with `wait_s`, waits that long for it to end, or (`more_than` given) for
        more than that many responses of a decoupled model, woken by the gateway's one
        subscription to job events (gateway/job_watch.py); no longer once `gone` resolves
        (its client left)."""
        if wait_s <= 0:
            return await self._read(job_id)
        deadline_s = time.monotonic() + wait_s
        with self.watch.watching(job_id, gone) as changed:
            while True:
                changed.clear()
                job = await self._read(job_id)
                left_s = deadline_s - time.monotonic()
                if job is None or job.result is not None or left_s <= 0:
                    return job
                if gone is not None and gone.done():
                    return job
                if more_than is not None and len(job.responses) > more_than:
                    return job
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), left_s)

    async def _read(self, job_id: str) -> Job | None:
        try:
            entries = cast(Entries, await self.redis.xrange(keys.job_stream(job_id)))
        except REDIS_ERRORS as exc:
            raise Unavailable(f"queue unavailable: {exc}", RETRY_AFTER_S) from None
        return read_job(job_id, entries)

    async def cancel(self, job_id: str) -> int:
        """1: cancelled; 0: already finished; -1: unknown."""
        fields = encode_results(
            [Result(job_id, error=("CANCELLED", "job was cancelled before it ran"))]
        )
        try:
            stream = keys.job_stream(job_id)
            return int(await CANCEL_JOB.run(self.redis, [stream], [fields["h"], fields["d"]]))
        except REDIS_ERRORS as exc:
            refused = "job not cancelled"
            raise redis_failure(exc, refused, "queue unavailable", RETRY_AFTER_S) from None
