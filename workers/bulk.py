"""The rq side of bulk jobs: feed a file's items to a model's stream and collect the answers.

Resuming is what matters: an rq worker can die at any point and the job runs again (rq retry)
from where it stopped. Feeding is one transaction in the model's slot (XADD of the items and
the count of items fed), so an item is fed once; answers are moved from the job's reply stream
into a results hash in one transaction, so an answer is kept once, and an item a model worker
happened to compute twice (after a crash) lands in the output once.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, cast

import msgpack
import orjson
import redis
from redis.typing import EncodableT, FieldT
from rq import SimpleWorker, get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from sluice.shared import keys
from sluice.shared.bulk import bulk_queue
from sluice.shared.bulk_arrays import MAX_BYTES
from sluice.shared.bulk_files import Item, read_items, write_output
from sluice.shared.drain_deadline import DrainDeadline
from sluice.shared.lua import Lua
from sluice.shared.protocol import Request, decode_results, encode_requests, encode_results
from sluice.shared.signature import Signature

log = logging.getLogger(__name__)

#: a feeder holds its job's lease this long past its last renewal.
LEASE_MS = 5_000
RENEW_S = 1.0
PROGRESS_S = 0.5
READ_BLOCK_MS = 500
READ_COUNT = 256
#: rq workers that run bulk jobs check for orphaned ones this often.
MAINTENANCE_S = 5

#: take or renew the lease if it is free, marked for a rerun, or already ours.
HOLD_LEASE = Lua(
    """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == 'requeued' or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
)
#: give the lease up only if it is still ours.
RELEASE_LEASE = Lua(
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
)


class LeaseLost(RuntimeError):
    """Another feeder took the job over (this one stalled past its lease)."""


@dataclass(frozen=True, slots=True)
class BulkSpec:
    id: str
    model: str
    version: int
    format: str
    total: int
    level: int
    window: int
    counted: bool
    ttl_s: int
    signature: Signature
    #: how far its `.npz` may inflate: the limit the upload was checked against.
    max_bytes: int = MAX_BYTES

    @classmethod
    def load(cls, connection: redis.Redis, bulk_id: str) -> BulkSpec:
        raw = cast("dict[bytes, bytes]", connection.hgetall(keys.bulk_key(bulk_id, "spec")))
        if not raw:
            raise LookupError(f"bulk job '{bulk_id}' has expired")
        return cls(
            bulk_id,
            raw[b"model"].decode(),
            int(raw[b"version"]),
            raw[b"format"].decode(),
            int(raw[b"total"]),
            int(raw[b"level"]),
            int(raw[b"window"]),
            raw[b"counted"] == b"1",
            int(raw[b"ttl"]),
            Signature.from_config(orjson.loads(raw[b"config"])),
            int(raw.get(b"max_bytes", MAX_BYTES)),
        )

    def key(self, part: str) -> str:
        return keys.bulk_key(self.id, part)


def run_bulk(bulk_id: str) -> dict[str, int | str]:
    """The rq job: runs (or resumes) a bulk job to its end and returns its summary."""
    job = get_current_job()
    assert job is not None, "run_bulk runs as an rq job"
    return BulkFeeder(job.connection, BulkSpec.load(job.connection, bulk_id), job).run()


class BulkFeeder:
    def __init__(self, connection: redis.Redis, spec: BulkSpec, job: Job) -> None:
        self.redis = connection
        self.spec = spec
        self.job = job
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{job.id}"
        self.replies = spec.key("replies")
        self.per_entry = max(1, spec.signature.max_batch_size)
        self.done: set[int] = set()
        self.failed = 0
        self.fed = 0
        self._renewed = self._reported = 0.0

    def run(self) -> dict[str, int | str]:
        if not self._take_lease():
            return self._summary()  # another feeder finished it meanwhile
        try:
            return self._run()
        finally:
            RELEASE_LEASE.run(self.redis, [self.spec.key("lease")], [self.owner])

    def _run(self) -> dict[str, int | str]:
        data = cast("bytes | None", self.redis.get(self.spec.key("input")))
        items = read_items(
            data or b"", self.spec.format, self.spec.signature, max_bytes=self.spec.max_bytes
        )
        self.done = {int(i) for i in self.redis.hkeys(self.spec.key("results"))}
        self.failed = int(self.redis.scard(self.spec.key("failed")))
        self.fed = int(self.redis.get(keys.bulk_fed(self.spec.model, self.spec.id)) or 0)
        if self.done or self.fed:
            log.info(
                "bulk %s: resuming at %d fed, %d answered", self.spec.id, self.fed, len(self.done)
            )
        last_id = b"0"  # answers that arrived while no feeder ran are still in the stream
        while len(self.done) < self.spec.total:
            if self.redis.hexists(self.spec.key("spec"), "cancelled"):
                log.info("bulk %s: cancelled after %d items", self.spec.id, len(self.done))
                return self._summary()
            self._feed(items)
            last_id = self._collect(last_id)
            self._keep_lease()
            self._report()
        self._finish(items)
        return self._summary()

    def _take_lease(self) -> bool:
        """Wait until no other live feeder holds the job (a requeued job may briefly run twice)."""
        lease = self.spec.key("lease")
        while True:
            if self.redis.exists(self.spec.key("output")):
                return False
            if HOLD_LEASE.run(self.redis, [lease], [self.owner, LEASE_MS]):
                self._renewed = time.monotonic()
                return True
            time.sleep(RENEW_S)

    def _keep_lease(self) -> None:
        if time.monotonic() - self._renewed < RENEW_S:
            return
        if not HOLD_LEASE.run(self.redis, [self.spec.key("lease")], [self.owner, LEASE_MS]):
            raise LeaseLost(f"bulk {self.spec.id}: another feeder holds it now")
        self._renewed = time.monotonic()

    def _feed(self, items: Sequence[Item]) -> None:
        room = self.spec.window - (self.fed - len(self.done))
        if room <= 0 or self.fed >= self.spec.total:
            return
        end = min(self.spec.total, self.fed + room)
        now_ns = time.time_ns()
        requests = [
            Request(
                f"{self.spec.id}#{i}",
                self.spec.version,
                now_ns,
                self.replies,
                items[i].inputs,
                items[i].outputs,
                items[i].parameters,
            )
            for i in range(self.fed, end)
        ]
        stream = keys.request_stream(self.spec.model, self.spec.level)
        pipe = self.redis.pipeline(transaction=True)  # one slot: the model's
        for start in range(0, len(requests), self.per_entry):
            entry = encode_requests(requests[start : start + self.per_entry])
            pipe.xadd(stream, cast("dict[FieldT, EncodableT]", entry))
        if self.spec.counted:
            pipe.hincrby(keys.queue_sizes(self.spec.model), str(self.spec.level), len(requests))
        pipe.set(keys.bulk_fed(self.spec.model, self.spec.id), end, ex=self.spec.ttl_s)
        pipe.execute()
        self.fed = end

    def _collect(self, last_id: bytes) -> bytes:
        read = self.redis.xread({self.replies: last_id}, count=READ_COUNT, block=READ_BLOCK_MS)
        if not read:
            return last_id
        ((_, entries),) = cast("list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]", read)
        answers: dict[int, bytes] = {}
        failed: list[int] = []
        for _, fields in entries:
            for result in decode_results(fields):
                index = int(result.id.rsplit("#", 1)[1])
                if index in self.done or index in answers:
                    continue
                fields_of_one = encode_results([result])
                answers[index] = msgpack.packb([fields_of_one["h"], fields_of_one["d"]])
                if result.error is not None:
                    failed.append(index)
        pipe = self.redis.pipeline(transaction=True)  # one slot: the bulk job's
        if answers:
            pipe.hset(self.spec.key("results"), mapping=cast("Mapping[FieldT, bytes]", answers))
            pipe.expire(self.spec.key("results"), self.spec.ttl_s)
        if failed:
            pipe.sadd(self.spec.key("failed"), *failed)
            pipe.expire(self.spec.key("failed"), self.spec.ttl_s)
        pipe.xdel(self.replies, *(entry_id for entry_id, _ in entries))
        pipe.execute()
        self.done.update(answers)
        self.failed += len(failed)
        return entries[-1][0]

    def _report(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._reported < PROGRESS_S:
            return
        self.job.meta.update(done=len(self.done), failed=self.failed, fed=self.fed)
        self.job.save_meta()
        self._reported = time.monotonic()

    def _finish(self, items: Sequence[Item]) -> None:
        results = []
        for start in range(0, self.spec.total, 1024):
            indices = range(start, min(self.spec.total, start + 1024))
            stored = self.redis.hmget(self.spec.key("results"), list(indices))
            for raw in cast("list[bytes]", stored):
                head, data = msgpack.unpackb(raw)
                results.append(decode_results({b"h": head, b"d": data})[0])
        output = write_output(
            self.spec.format, self.spec.signature, self.spec.version, items, results
        )
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.spec.key("output"), output, ex=self.spec.ttl_s)
        pipe.delete(*(self.spec.key(p) for p in ("input", "results", "failed", "replies")))
        pipe.execute()
        self.redis.delete(keys.bulk_fed(self.spec.model, self.spec.id))
        self._report(force=True)
        log.info("bulk %s: %d items, %d failed", self.spec.id, self.spec.total, self.failed)

    def _summary(self) -> dict[str, int | str]:
        return {
            "id": self.spec.id,
            "total": self.spec.total,
            "done": len(self.done),
            "failed": self.failed,
        }


class BulkWorker(SimpleWorker):
    """An rq worker for bulk jobs. It runs a job in its own process (no fork: killing the worker
    stops that feeder too), and runs again within seconds a job whose feeder stopped renewing
    its lease, where rq's own abandoned-job check waits for the job's timeout."""

    #: bounds rq's warm shutdown, which would wait for the running job however long it feeds.
    drain: DrainDeadline | None = None
    _running_job: str | None = None
    #: how long the pub/sub listener waits for a message (or a subscription) between checks
    #: that it was told to stop.
    PUBSUB_POLL_S = 1.0

    @property
    def dequeue_timeout(self) -> int:
        return MAINTENANCE_S  # an idle worker wakes up this often to look for orphans

    def run_maintenance_tasks(self) -> None:
        super().run_maintenance_tasks()  # type: ignore[no-untyped-call]  # rq's, unannotated
        requeue_orphans(self.connection)

    def execute_job(self, job: Job, queue: Any) -> Any:
        self._running_job = job.id
        try:
            return super().execute_job(job, queue)
        finally:
            self._running_job = None

    def subscribe(self) -> None:
        """rq's, with a listener that polls every PUBSUB_POLL_S rather than rq's 60 s. rq's
        teardown sends UNSUBSCRIBE and then stops the listener, which redis-py (8.2) joins with
        no timeout: a listener that read the reply first waits its whole poll for a subscription,
        and an idle worker then outlived its drain timeout."""
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        self.pubsub = self.connection.pubsub()
        self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        # rq's __init__ types the attribute by its initial None
        self.pubsub_thread = self.pubsub.run_in_thread(  # type: ignore[assignment]
            sleep_time=self.PUBSUB_POLL_S,
            daemon=True,
            exception_handler=self._pubsub_exception_handler,
        )

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        if self.drain is not None:
            self.drain.signal()
        super().request_stop(signum, frame)  # type: ignore[no-untyped-call]  # rq's, unannotated

    def request_force_stop(self, signum: int, frame: FrameType | None) -> None:
        if self.drain is not None:
            self.drain.signal()  # the second signal: out at once
        super().request_force_stop(signum, frame)

    def in_hand(self) -> str:
        """What a cut-short drain leaves: a job another rq worker resumes once its lease lapses."""
        job = self._running_job
        return f"bulk job {job} (resumed by another rq worker once its lease lapses)" if job else ""


class QuietMaintenance(logging.Filter):
    """rq logs its registry cleaning at INFO every MAINTENANCE_S; it is routine, so DEBUG."""

    ROUTINE = ("cleaning registries", "cleaning group registries")

    def filter(self, record: logging.LogRecord) -> bool:
        if not any(text in str(record.msg) for text in self.ROUTINE):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def requeue_orphans(connection: redis.Redis) -> list[str]:
    """Run again (rq retry) started bulk jobs whose feeder's lease has lapsed."""
    queue = bulk_queue(connection)
    registry = queue.started_job_registry
    requeued = []
    for job_id in registry.get_job_ids(cleanup=False):
        lease = keys.bulk_key(job_id, "lease")
        if connection.exists(lease):
            continue
        try:
            job = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
        except NoSuchJobError:
            continue
        started_s = job.started_at.timestamp() if job.started_at else 0.0
        if job.get_status() != JobStatus.STARTED or time.time() - started_s < LEASE_MS / 1000:
            continue  # a feeder that is starting has not taken its lease yet
        if not job.retries_left:
            continue  # out of retries: rq's own check fails it
        if not connection.set(lease, "requeued", nx=True, px=30_000):
            continue  # another rq worker is requeueing it
        with connection.pipeline() as pipe:
            registry.remove_executions(job, pipeline=pipe)
            job.retry(queue, pipe)
            pipe.execute()
        log.warning("bulk %s: its rq worker stopped; running it again", job_id)
        requeued.append(job_id)
    return requeued
