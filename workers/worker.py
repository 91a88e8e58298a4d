"""A worker process: loads a repository's models and serves their streams until told to stop."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import uvloop
from redis.asyncio.client import Pipeline
from sluice.shared import keys
from sluice.shared.device_metrics import INFO_KEY as DEVICE_METRICS
from sluice.shared.drain_deadline import DEFAULT_DRAIN_TIMEOUT_S, DrainDeadline, on_stop_signals
from sluice.shared.errors import ModelConfigError
from sluice.shared.gc_tuning import settle_after_startup
from sluice.shared.idle_poll import DEFAULT_WINDOW_US
from sluice.shared.redis_client import REDIS_ERRORS, async_client
from sluice.shared.registry import (
    HEARTBEAT_INTERVAL_S,
    Member,
    ModelStatus,
    encode_model_record,
    now_ms,
)
from sluice.shared.repository import ModelEntry, scan_repository
from sluice.shared.tasks import stop_tasks
from sluice.workers.device_sampler import DeviceSampler
from sluice.workers.health import HEALTH_SHUTDOWN_S, serve_health
from sluice.workers.model_queue import ModelQueue
from sluice.workers.models import Infer, choose_device, load_instance
from sluice.workers.recovery import RecoveryPolicy

log = logging.getLogger(__name__)

#: a model ready to serve: its entry, instances per version, and device.
Loaded = tuple[ModelEntry, dict[int, list[Infer]], torch.device]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    """Built from the command line's settings in one place (sluice.settings)."""

    model_repository: Path
    redis_url: str
    #: serve only these models (None: every model in the repository).
    models: tuple[str, ...] | None = None
    worker_id: str = ""
    block_ms: int = 1000
    recovery: RecoveryPolicy = field(default_factory=RecoveryPolicy)
    #: serve GET /v2/health/live and /ready here (None: no probe port).
    health_port: int | None = None
    health_host: str = "127.0.0.1"
    #: microseconds to keep polling after a batch run at low load (0: sleep at once).
    idle_poll_us: int = DEFAULT_WINDOW_US
    #: how often the host's CPU, memory and GPUs are sampled for the heartbeat (Triton's
    #: --metrics-interval-ms).
    metrics_interval_ms: int = 2000
    #: BATCH_DELAY of models that set none: "fixed" (Triton's wait) or "adaptive".
    batch_delay: str = "fixed"
    #: seconds to finish the batches in hand after a stop signal before exiting regardless.
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S

    def member_id(self) -> str:
        suffix = uuid.uuid4().hex[:6]
        return self.worker_id or f"worker-{socket.gethostname()}-{os.getpid()}-{suffix}"


def configure_threads(entries: list[ModelEntry]) -> None:
    """Apply the PyTorch backend's INTRA/INTER_OP_THREAD_COUNT (process-wide in torch)."""
    specs = [e.spec for e in entries if e.spec is not None]
    intra = {s.intra_op_threads for s in specs if s.intra_op_threads}
    inter = {s.inter_op_threads for s in specs if s.inter_op_threads}
    if len(intra) > 1 or len(inter) > 1:
        log.warning(
            "models ask for different thread counts; using the largest (torch threads are "
            "per process: run them in separate workers with --models to honour each)"
        )
    if intra:
        torch.set_num_threads(max(intra))
    if inter:
        try:
            torch.set_num_interop_threads(max(inter))
        except RuntimeError as exc:  # already set in this process
            log.warning("INTER_OP_THREAD_COUNT not applied: %s", exc)


def load_model(entry: ModelEntry) -> tuple[dict[int, list[Infer]], torch.device]:
    """Every selected version, `instance_count` instances each."""
    assert entry.spec is not None
    device = choose_device(entry.spec)
    instances = {
        version: [
            load_instance(entry.spec, entry.path, version, device)
            for _ in range(entry.spec.instance_count)
        ]
        for version in entry.versions
    }
    return instances, device


@dataclass(slots=True)
class BatchRate:
    """Batches per second between two heartbeats, for `sluice status`."""

    batches: int = 0
    at: float | None = None

    def update(self, batches: int, now: float) -> float:
        rate = 0.0
        if self.at is not None and now > self.at:
            rate = round((batches - self.batches) / (now - self.at), 2)
        self.batches, self.at = batches, now
        return rate


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.id = config.member_id()
        self.redis = async_client(config.redis_url)
        self.queues: list[ModelQueue] = []
        self.statuses: dict[str, ModelStatus] = {}
        #: whether the last heartbeat reached Redis (readiness).
        self.redis_ok = False
        self._rate = BatchRate()
        self.sampler = DeviceSampler.for_this_host(config.metrics_interval_ms)
        self._stopped = asyncio.Event()
        self.drain = DrainDeadline(config.drain_timeout_s, f"worker {self.id}", self._in_hand)

    def _load(self) -> list[Loaded]:
        entries = scan_repository(self.config.model_repository)
        if self.config.models is not None:
            wanted = set(self.config.models)
            entries = [e for e in entries if e.name in wanted]
            for missing in wanted - {e.name for e in entries}:
                log.error("model %r is not in %s", missing, self.config.model_repository)
        configure_threads(entries)
        loaded = []
        for entry in entries:
            if entry.error or entry.spec is None:
                log.error("model %r not loaded: %s", entry.name, entry.error)
                self.statuses[entry.name] = ModelStatus([], entry.error)
                continue
            try:
                instances, device = load_model(entry)
            except ModelConfigError as exc:
                log.error("model %r not loaded: %s", entry.name, exc.message)
                self.statuses[entry.name] = ModelStatus([], exc.message)
                continue
            self.statuses[entry.name] = ModelStatus(list(entry.versions), None)
            loaded.append((entry, instances, device))
            log.info("model %r versions %s ready on %s", entry.name, entry.versions, device)
        return loaded

    def _announce(self, pipe: Pipeline) -> None:
        """Model records and our heartbeat; re-sent every beat so a Redis that lost its data
        learns them again."""
        for queue in self.queues:
            versions = sorted(queue.instances.by_version)
            record = encode_model_record(queue.spec.config_json, versions, None)
            pipe.hset(keys.MODELS, queue.spec.name, record)
        for name, status in self.statuses.items():
            if not status.ready_versions:
                pipe.hsetnx(keys.MODELS, name, encode_model_record(None, [], status.reason))
        pipe.hset(keys.FLEET, self.id, self._member().encode())

    def _member(self) -> Member:
        batches = sum(q.batches_done for q in self.queues)
        return Member(
            self.id,
            "worker",
            socket.gethostname(),
            os.getpid(),
            now_ms(),
            self.statuses,
            {
                "batches": batches,
                "batches_per_s": self._rate.update(batches, time.monotonic()),
                "devices": sorted({str(q.instances.device) for q in self.queues}),
                "instances": {
                    q.spec.name: sum(len(lanes) for lanes in q.instances.by_version.values())
                    for q in self.queues
                },
                DEVICE_METRICS: self.sampler.latest,
            },
        )

    async def _heartbeat(self) -> None:
        while True:
            async with self.redis.pipeline(transaction=False) as pipe:
                self._announce(pipe)
                try:
                    await pipe.execute()
                    self.redis_ok = True
                except REDIS_ERRORS as exc:  # Redis down: keep serving, report when it is back
                    self.redis_ok = False
                    log.warning("heartbeat failed: %s", exc)
                await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def _listen_for_cancellations(self) -> None:
        """Gateways publish the ids of requests whose client went away; drop those not started."""
        by_channel = {keys.cancel_channel(q.spec.name).encode(): q for q in self.queues}
        client = async_client(self.config.redis_url, socket_timeout_s=None)
        backoff = 0.05
        try:
            while True:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                try:
                    await pubsub.subscribe(*by_channel)
                    backoff = 0.05
                    async for message in pubsub.listen():
                        queue = by_channel.get(message["channel"])
                        if queue is not None and message["type"] == "message":
                            queue.cancel(message["data"].decode())
                except REDIS_ERRORS as exc:
                    log.warning("cancellation channel lost (%s); resubscribing", exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                finally:
                    await pubsub.aclose()
        finally:
            await client.aclose()

    def stop(self) -> None:
        log.info("worker %s stopping: finishing the batches in hand", self.id)
        self._stopped.set()
        for queue in self.queues:
            queue.stop()

    def _in_hand(self) -> str:
        """What a cut-short drain leaves: the requests stay pending in their streams, where
        another worker takes them over after --claim-idle-ms."""
        busy = [
            f"{q.spec.name}: {q.state.busy_lanes} batches running, "
            f"{len(q.state.pending)} requests waiting"
            for q in self.queues
            if q.state.in_hand
        ]
        if not busy:
            return ""
        return "; ".join(busy) + " (left pending in Redis for another worker to take over)"

    def ready(self) -> bool:
        return bool(self.queues) and self.redis_ok

    async def run(self) -> None:
        health = None
        if self.config.health_port is not None:
            health = await serve_health(
                self.config.health_host, self.config.health_port, self.ready
            )
        loaded = await asyncio.to_thread(self._load)
        for entry, instances, device in loaded:
            assert entry.spec is not None
            reader = async_client(self.config.redis_url, socket_timeout_s=None)
            self.queues.append(
                ModelQueue(
                    entry.spec,
                    instances,
                    device,
                    self.redis,
                    reader,
                    self.id,
                    self.config.block_ms,
                    self.config.recovery,
                    self.config.idle_poll_us,
                    self.config.batch_delay,
                )
            )
        settle_after_startup()
        on_stop_signals(self.drain, asyncio.get_running_loop(), self.stop)
        self.sampler.start()
        helpers = [asyncio.create_task(self._heartbeat())]
        if self.queues:
            helpers.append(asyncio.create_task(self._listen_for_cancellations()))
        try:
            await asyncio.gather(*(q.run() for q in self.queues))
            if not self.queues:
                log.error("no model could be loaded; waiting for a signal")
                await self._stopped.wait()
        finally:
            await stop_tasks(helpers)
            self.sampler.stop()
            if health is not None:
                await health.shutdown(HEALTH_SHUTDOWN_S)
            try:
                await self.redis.hdel(keys.FLEET, self.id)
            except REDIS_ERRORS as exc:  # best effort: the entry also expires on its own
                log.warning("could not remove fleet entry: %s", exc)
            await self.redis.aclose()
            for q in self.queues:
                await q.reader.aclose()


def run_worker(config: WorkerConfig) -> None:
    """Entry point of `sluice worker`."""
    uvloop.run(Worker(config).run())
