"""Bulk jobs: a file of inputs run through a model by an rq job, results kept in input order.

Submitting stores the file and the job's spec in Redis and enqueues `sluice.workers.bulk.run_bulk`
on rq's `sluice-bulk` queue with rq's JSON serializer (no pickle). The job feeds the items onto
the model's stream as ordinary requests, so the fleet's workers batch them with everything
else, and collects the answers; any process that reaches the Redis (CLI, gateway) reads the
progress from the rq job's meta and the results file from Redis when it is done.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, cast

import orjson
import redis
from redis.typing import EncodableT, FieldT
from rq import Queue, Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from sluice.shared import keys
from sluice.shared.bulk_files import check_output_shapes, read_items
from sluice.shared.errors import (
    InvalidInput,
    JobNotFound,
    ModelNotFound,
    ModelNotReady,
    Unavailable,
)
from sluice.shared.jobs import JOB_ID
from sluice.shared.queue_policy import QueuePolicy
from sluice.shared.redis_client import is_cluster
from sluice.shared.registry import decode_model_record
from sluice.shared.signature import Signature

#: the rq job function (a string, so that nothing here imports the workers package).
RUN_BULK = "sluice.workers.bulk.run_bulk"
#: requests in flight per bulk job, unless the model's max_queue_size asks for fewer.
DEFAULT_WINDOW = 512
#: how often rq runs a bulk job again after its rq worker died.
RETRIES = 5
DEFAULT_TTL_S = 24 * 3600

_STATUS = {
    JobStatus.QUEUED: "queued",
    JobStatus.DEFERRED: "queued",
    JobStatus.SCHEDULED: "queued",
    JobStatus.STARTED: "running",
    JobStatus.FINISHED: "done",
    JobStatus.FAILED: "failed",
    JobStatus.STOPPED: "cancelled",
    JobStatus.CANCELED: "cancelled",
}


@dataclass(frozen=True, slots=True)
class BulkStatus:
    id: str
    model: str
    format: str
    #: queued, running, done, failed (the job itself, not an item) or cancelled.
    status: str
    total: int
    done: int
    failed: int
    error: str | None = None
    created_ms: int = 0

    def to_json(self) -> dict[str, Any]:
        body = {
            "id": self.id,
            "model": self.model,
            "format": self.format,
            "status": self.status,
            "total": self.total,
            "done": self.done,
            "failed": self.failed,
        }
        return body | ({"error": self.error} if self.error else {})


def bulk_queue(connection: redis.Redis) -> Queue:
    if is_cluster(connection):
        raise Unavailable(
            "bulk jobs run on rq, which needs a Redis that is not a cluster: use a plain "
            "Redis URL (no ?cluster=true) for them"
        )
    return Queue(keys.BULK_QUEUE, connection=connection, serializer=JSONSerializer)


def model_signature(connection: redis.Redis, model: str) -> tuple[dict[str, Any], list[int]]:
    """The model's config as the workers published it, and its versions."""
    # sluice's clients never decode replies: values are bytes
    record = cast("bytes | None", connection.hget(keys.MODELS, model))
    if record is None:
        raise ModelNotFound(f"Request for unknown model: '{model}' is not found")
    info = decode_model_record(record)
    if info["config"] is None:
        raise ModelNotReady(f"model '{model}' is not ready: {info['error']}")
    return info["config"], list(info["versions"])


def submit_bulk(
    connection: redis.Redis,
    model: str,
    data: bytes,
    fmt: str,
    *,
    bulk_id: str | None = None,
    version: int | None = None,
    window: int = DEFAULT_WINDOW,
    ttl_s: int = DEFAULT_TTL_S,
) -> BulkStatus:
    """Validate the file, store it and enqueue its rq job; an existing `bulk_id` is returned as
    it is (idempotent submission)."""
    queue = bulk_queue(connection)
    bulk_id = bulk_id or uuid.uuid4().hex
    if not JOB_ID.match(bulk_id):
        raise InvalidInput("bulk job 'id' must be 1-128 characters of A-Z a-z 0-9 . _ : -")
    if connection.exists(keys.bulk_key(bulk_id, "spec")):
        return bulk_status(connection, bulk_id)
    config, versions = model_signature(connection, model)
    if version is not None and version not in versions:
        raise ModelNotReady(f"model '{model}' version {version} is not ready")
    sig = Signature.from_config(config)
    check_output_shapes(sig, fmt)
    total = len(read_items(data, fmt, sig))
    policy = QueuePolicy.from_config(config)
    level = policy.default_priority_level
    limit = policy.for_level(level).max_queue_size
    spec: dict[FieldT, EncodableT] = {
        "model": model,
        "version": version or max(versions),
        "format": fmt,
        "total": total,
        "level": level,
        # leave half a bounded queue to interactive requests
        "window": max(1, min(window, limit // 2)) if limit else window,
        "counted": int(limit > 0),
        "ttl": ttl_s,
        "config": orjson.dumps(config),
        "created_ms": time.time_ns() // 1_000_000,
    }
    pipe = connection.pipeline(transaction=True)
    pipe.set(keys.bulk_key(bulk_id, "input"), data, ex=ttl_s)
    pipe.hset(keys.bulk_key(bulk_id, "spec"), mapping=spec)
    pipe.expire(keys.bulk_key(bulk_id, "spec"), ttl_s)
    pipe.execute()
    queue.enqueue(
        RUN_BULK,
        bulk_id,
        job_id=bulk_id,
        retry=Retry(max=RETRIES),
        job_timeout=ttl_s,
        result_ttl=ttl_s,
        failure_ttl=ttl_s,
        description=f"sluice bulk {model} ({total} items)",
        meta={"model": model, "total": total, "done": 0, "failed": 0},
    )
    return bulk_status(connection, bulk_id)


def _spec(connection: redis.Redis, bulk_id: str) -> dict[bytes, bytes]:
    spec = cast("dict[bytes, bytes]", connection.hgetall(keys.bulk_key(bulk_id, "spec")))
    if not spec:
        raise JobNotFound(f"bulk job '{bulk_id}' is unknown or expired")
    return spec


def _load(connection: redis.Redis, bulk_id: str) -> tuple[dict[bytes, bytes], Job]:
    spec = _spec(connection, bulk_id)
    try:
        return spec, Job.fetch(bulk_id, connection=connection, serializer=JSONSerializer)
    except NoSuchJobError:
        raise JobNotFound(f"bulk job '{bulk_id}' is unknown or expired") from None


def bulk_status(connection: redis.Redis, bulk_id: str) -> BulkStatus:
    return _status_of(bulk_id, *_load(connection, bulk_id))


def _status_of(bulk_id: str, spec: dict[bytes, bytes], job: Job) -> BulkStatus:
    status = _STATUS.get(job.get_status(), "queued")
    if spec.get(b"cancelled"):
        status = "cancelled"
    error = _failure(job) if status == "failed" else None
    meta = job.get_meta()
    return BulkStatus(
        bulk_id,
        spec[b"model"].decode(),
        spec[b"format"].decode(),
        status,
        int(spec[b"total"]),
        int(meta.get("done", 0)),
        int(meta.get("failed", 0)),
        error,
        int(spec.get(b"created_ms", 0)),
    )


def _failure(job: Job) -> str:
    """The last line of the exception that failed the rq job."""
    result = job.latest_result()
    lines = ((result.exc_string if result else None) or "").strip().splitlines()
    return lines[-1] if lines else "bulk job failed"


def cancel_bulk(connection: redis.Redis, bulk_id: str) -> BulkStatus:
    """Stop feeding a bulk job (items already fed still run); no-op once it has finished."""
    spec, job = _load(connection, bulk_id)
    status = _status_of(bulk_id, spec, job)
    if status.status in ("done", "failed", "cancelled"):
        return status
    connection.hset(keys.bulk_key(bulk_id, "spec"), "cancelled", 1)
    if job.get_status() in (JobStatus.QUEUED, JobStatus.SCHEDULED, JobStatus.DEFERRED):
        job.cancel()
    return bulk_status(connection, bulk_id)


def bulk_output(connection: redis.Redis, bulk_id: str) -> tuple[BulkStatus, bytes | None]:
    """The job's status, and its results file once it is done (None before)."""
    status = bulk_status(connection, bulk_id)
    if status.status != "done":
        return status, None
    return status, cast("bytes | None", connection.get(keys.bulk_key(bulk_id, "output")))


def list_bulks(connection: redis.Redis) -> list[BulkStatus]:
    """Every bulk job rq still knows of, newest first."""
    queue = bulk_queue(connection)
    ids: list[str] = list(queue.get_job_ids())
    for registry in (
        queue.started_job_registry,
        queue.finished_job_registry,
        queue.failed_job_registry,
        queue.canceled_job_registry,
    ):
        ids += registry.get_job_ids()
    found = []
    for bulk_id in dict.fromkeys(ids):
        try:
            found.append(bulk_status(connection, bulk_id))
        except JobNotFound:
            continue
    return sorted(found, key=lambda s: s.created_ms, reverse=True)
