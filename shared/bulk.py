"""Bulk jobs: a file of inputs run through a model by an rq job, results kept in input order.

Submitting stores the file and the job's spec in Redis and enqueues `sluice.workers.bulk.run_bulk`
on rq's `sluice-bulk` queue with rq's JSON serializer (no pickle). The job feeds the items onto
the model's stream as ordinary requests, so the fleet's workers batch them with everything
else, and collects the answers; any process that reaches the Redis (CLI, gateway) reads the
progress from the rq job's meta and the results file from Redis when it is done.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, cast

import orjson
import redis
from redis.typing import EncodableT
from rq import Queue, Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from sluice.shared import keys
from sluice.shared.bulk_arrays import MAX_BYTES
from sluice.shared.bulk_files import check_output_shapes, read_items
from sluice.shared.config_view import ConfigView
from sluice.shared.errors import (
    Conflict,
    InvalidInput,
    JobNotFound,
    ModelNotFound,
    ModelNotReady,
    Unavailable,
)
from sluice.shared.jobs import HOLD_QUOTA, JOB_ID, MAX_BULK_JOBS, quota_message
from sluice.shared.lua import Lua
from sluice.shared.redis_client import is_cluster, out_of_memory
from sluice.shared.registry import ModelRecord

#: the rq job function (a string, so that nothing here imports the workers package).
RUN_BULK = "sluice.workers.bulk.run_bulk"
#: requests in flight per bulk job, unless the model's max_queue_size asks for fewer.
DEFAULT_WINDOW = 512
#: store a bulk job's spec (ARGV[3..], field value ...) and input (ARGV[2]) with a TTL
#: (ARGV[1]) unless its spec exists: 1 stored, 0 there already.
CREATE_BULK = Lua(
    """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""
)
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


def model_signature(connection: redis.Redis, model: str) -> tuple[ConfigView, list[int]]:
    """The model's config as the workers published it, and its versions."""
    # sluice's clients never decode replies: values are bytes
    raw = cast("bytes | None", connection.hget(keys.MODELS, model))
    if raw is None:
        raise ModelNotFound(f"Request for unknown model: '{model}' is not found")
    record = ModelRecord.decode(raw)
    if record.config is None:
        raise ModelNotReady(f"model '{model}' is not ready: {record.error}")
    return record.config, record.versions


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
    max_bytes: int = MAX_BYTES,
    max_jobs: int = MAX_BULK_JOBS,
) -> BulkStatus:
    """Validate the file (an `.npz` inflating to `max_bytes` at most), store it and enqueue
    its rq job. `bulk_id` is an idempotency key: the same upload under it again is the job
    already there, another one a Conflict. At most `max_jobs` bulk jobs are kept fleet-wide
    (0: no limit), each until its TTL ends; past that, Unavailable."""
    queue = bulk_queue(connection)
    bulk_id = bulk_id or uuid.uuid4().hex
    if not JOB_ID.match(bulk_id):
        raise InvalidInput("bulk job 'id' must be 1-128 characters of A-Z a-z 0-9 . _ : -")
    digest = _upload_digest(model, version, fmt, window, data)
    if connection.exists(keys.bulk_key(bulk_id, "spec")):
        return _existing(connection, bulk_id, digest)
    config, versions = model_signature(connection, model)
    if version is not None and version not in versions:
        raise ModelNotReady(f"model '{model}' version {version} is not ready")
    sig = config.signature
    check_output_shapes(sig, fmt)
    total = len(read_items(data, fmt, sig, max_bytes=max_bytes))
    policy = config.queue_policy
    level = policy.default_priority_level
    limit = policy.for_level(level).max_queue_size
    spec: dict[str, EncodableT] = {
        "model": model,
        "version": version or max(versions),
        "format": fmt,
        "total": total,
        "level": level,
        # leave half a bounded queue to interactive requests
        "window": max(1, min(window, limit // 2)) if limit else window,
        "counted": int(limit > 0),
        "ttl": ttl_s,
        "config": orjson.dumps(config.json),
        "created_ms": time.time_ns() // 1_000_000,
        "max_bytes": max_bytes,
        "digest": digest,
    }
    counted = HOLD_QUOTA.run(connection, [keys.BULK_KEPT], [bulk_id, ttl_s, max_jobs])
    if not counted:
        raise Unavailable(quota_message("bulk jobs", max_jobs, "--max-bulk-jobs"))
    fields = [part for pair in spec.items() for part in pair]
    spec_key, input_key = keys.bulk_key(bulk_id, "spec"), keys.bulk_key(bulk_id, "input")
    if not CREATE_BULK.run(connection, [spec_key, input_key], [ttl_s, data, *fields]):
        if counted == 1:  # another upload under this id won meanwhile: it holds the count
            connection.zrem(keys.BULK_KEPT, bulk_id)
        return _existing(connection, bulk_id, digest)
    try:
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
    except redis.RedisError as exc:
        if out_of_memory(exc):  # nothing queued: leave no job that a retry would find
            connection.delete(spec_key, input_key, Job.key_for(bulk_id))
            if counted == 1:
                connection.zrem(keys.BULK_KEPT, bulk_id)
            connection.zrem(keys.BULK_KEPT, bulk_id)
        raise
    return bulk_status(connection, bulk_id)


def _upload_digest(model: str, version: int | None, fmt: str, window: int, data: bytes) -> str:
    """What makes two uploads under one bulk id the same: model and version as named, the
    file's format and bytes, the window."""
    digest = hashlib.blake2b(f"{model}\0{version or ''}\0{fmt}\0{window}\0".encode())
    digest.update(data)
    return digest.hexdigest()


def _existing(connection: redis.Redis, bulk_id: str, digest: str) -> BulkStatus:
    """The bulk job already under `bulk_id`, if it was made of the same upload."""
    stored = cast("bytes | None", connection.hget(keys.bulk_key(bulk_id, "spec"), "digest"))
    if stored is not None and stored.decode() != digest:
        raise Conflict(
            f"bulk job '{bulk_id}' already exists for another upload (model, version, file, "
            "format or window differ): give each upload its own id"
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
