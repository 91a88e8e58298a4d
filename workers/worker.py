"""A worker process: loads a repository's models and serves their streams until told to stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import uvloop
from redis.asyncio.client import Pipeline
from sluice.shared import keys
from sluice.shared.backoff import Backoff
from sluice.shared.custom_metrics import INFO_KEY as CUSTOM_METRICS
from sluice.shared.device_metrics import INFO_KEY as DEVICE_METRICS
from sluice.shared.device_metrics import PRICE_KEY
from sluice.shared.drain_deadline import DrainDeadline, on_stop_signals
from sluice.shared.gc_tuning import settle_after_startup
from sluice.shared.log_control import process_control
from sluice.shared.model_config import ModelSpec
from sluice.shared.otel import exporting
from sluice.shared.redis_client import REDIS_ERRORS, async_client, initialized, out_of_memory
from sluice.shared.registry import (
    HEARTBEAT_INTERVAL_S,
    SEQUENCES,
    Member,
    ModelStatus,
    encode_model_record,
    now_ms,
)
from sluice.shared.repository_control import (
    ALL_MODELS,
    DesiredModel,
    announce_command,
    decode_all,
    read_desired,
)
from sluice.shared.supervision import Supervisor
from sluice.shared.tasks import stop_tasks
from sluice.shared.when_full import past_maxmemory
from sluice.workers.backends import complete_config
from sluice.workers.batching.model_queue import ModelQueue
from sluice.workers.devices.device_sampler import DeviceSampler
from sluice.workers.health import HEALTH_SHUTDOWN_S, serve_health
from sluice.workers.instances.model_instance import ModelInstance
from sluice.workers.models.model_manager import ModelManager
from sluice.workers.models.override_files import OverrideDirectory
from sluice.workers.models.served_models import ServedModels
from sluice.workers.python_backend import bls, model_control
from sluice.workers.python_backend.custom_metrics import REGISTRY as MODEL_METRICS
from sluice.workers.worker_config import WorkerConfig

log = logging.getLogger(__name__)

#: a lost cancellation channel is subscribed to again after this, doubling with each failure...
RESUBSCRIBE_FIRST_S = 0.05
#: ...up to this.
RESUBSCRIBE_MAX_S = 2.0


def _raise_unless_full(replies: list[Any]) -> None:
    """A heartbeat's error replies: Redis out of memory refused the model records (they go
    again next beat; the heartbeat itself got in); any other error is raised."""
    errors = [reply for reply in replies if isinstance(reply, Exception)]
    for error in errors:
        if not out_of_memory(error):
            raise error
    if errors:
        log.warning("Redis is out of memory: model records not refreshed")


@dataclass(slots=True)
class BatchRate:
    """Batches per second between two heartbeats, for `sluice status`."""

    batches: int = 0
    at_s: float | None = None

    def update(self, batches: int, now_s: float) -> float:
        rate = 0.0
        if self.at_s is not None and now_s > self.at_s:
            rate = round((batches - self.batches) / (now_s - self.at_s), 2)
        self.batches, self.at_s = batches, now_s
        return rate


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.id = config.member_id()
        self.redis = async_client(config.redis_url)
        bls.use_redis(config.redis_url)  # Triton Python models' BLS calls go through it
        model_control.configure(config.redis_url, config.model_control_mode)
        #: the models served and what changes them, built in `run` (it needs the running loop).
        self.served: ServedModels | None = None
        self.manager: ModelManager | None = None
        #: whether the last heartbeat reached Redis (readiness).
        self.redis_ok = False
        self._rate = BatchRate()
        self.sampler = DeviceSampler.for_this_host(config.metrics_interval_ms)
        self._stopped = asyncio.Event()
        #: a model changed state, or the desired state changed: beat now, not in a second.
        self._beat_now = asyncio.Event()
        #: the models whose cancellation channels the listener subscribed to.
        self._listened: frozenset[str] = frozenset()
        self._models_changed = asyncio.Event()
        self.drain = DrainDeadline(
            config.drain_timeout_s, f"worker {self.id}", lambda: _in_hand(self.queues)
        )
        #: the heartbeat, the cancellation listener, the log-settings follower and the
        #: repository poll: each run again after a backoff should it fail.
        self.helpers = Supervisor()
        trace = config.trace_config
        #: OpenTelemetry mode: the exporter of this worker's spans of traced requests.
        self.exporting = exporting(trace, "worker") if trace.opentelemetry else None

    @property
    def explicit(self) -> bool:
        return self.config.model_control_mode == "explicit"

    @property
    def queues(self) -> list[ModelQueue]:
        return list(self.served.queues.values()) if self.served is not None else []

    @property
    def statuses(self) -> dict[str, ModelStatus]:
        return self.served.statuses if self.served is not None else {}

    def _new_queue(
        self,
        spec: ModelSpec,
        instances: dict[int, list[ModelInstance]],
        device: torch.device,
        consumer: str,
    ) -> ModelQueue:
        reader = async_client(self.config.redis_url, socket_timeout_s=None)
        queue = ModelQueue(
            spec,
            instances,
            device,
            self.redis,
            reader,
            consumer,
            self.config.block_ms,
            self.config.recovery,
            self.config.idle_poll_us,
            self.config.batch_delay,
            self.config.early_run,
            self.exporting,
        )
        if self._stopped.is_set():  # loaded while stopping: it only finishes
            queue.stop()
        return queue

    def _changed(self) -> None:
        self._beat_now.set()
        if frozenset(self.served.queues if self.served else ()) != self._listened:
            self._models_changed.set()

    def _announce(self, pipe: Pipeline) -> None:
        """Model records and our heartbeat; re-sent every beat so a Redis that lost its data
        learns them again."""
        for name, config_json, versions in _served(self.manager):
            record = encode_model_record(config_json, versions, None)
            if self.explicit:  # not over the config of a load this worker has yet to apply
                status = self.statuses.get(name)
                applied = status.generation if status is not None else 0
                pipe.execute_command(*announce_command(name, applied, record))
            else:
                pipe.hset(keys.MODELS, name, record)
        for name, status in self.statuses.items():
            if not status.ready_versions:
                pipe.hsetnx(keys.MODELS, name, encode_model_record(None, [], status.reason))
        # a full Redis still takes it: a fleet whose Redis is full is not dead
        pipe.execute_command(*past_maxmemory("HSET", keys.FLEET, self.id, self._member().encode()))

    def _member(self) -> Member:
        queues = self.queues
        batches = sum(q.batches_done for q in queues)
        rate = self._rate.update(batches, time.monotonic())
        usage: dict[str, Any] = {
            "batches": batches,
            "batches_per_s": rate,
            DEVICE_METRICS: self.sampler.latest,
        }
        if self.config.price_per_hour is not None:
            usage[PRICE_KEY] = self.config.price_per_hour
        custom = MODEL_METRICS.snapshot()
        if custom:  # Python models' own (pb_utils.MetricFamily), for the gateways' /metrics
            usage[CUSTOM_METRICS] = custom
        usage.update(_usage(queues))
        scope = self.manager.scope() if self.manager is not None else []
        host, pid = socket.gethostname(), os.getpid()
        return Member(self.id, "worker", host, pid, now_ms(), dict(self.statuses), usage, scope)

    async def _heartbeat(self) -> None:
        """Every beat (or at once when something changed): announce ourselves and, in explicit
        mode, read the fleet's desired state and follow it."""
        while True:
            self._beat_now.clear()
            async with self.redis.pipeline(transaction=False) as pipe:
                self._announce(pipe)
                if self.explicit:
                    pipe.hgetall(keys.DESIRED)
                try:
                    replies = await pipe.execute(raise_on_error=False)
                    _raise_unless_full(replies)
                    self.redis_ok = True
                except REDIS_ERRORS as exc:  # Redis down: keep serving, report when it is back
                    self.redis_ok = False
                    log.warning("heartbeat failed: %s", exc)
                else:
                    if self.explicit and self.manager is not None:
                        self.manager.follow(decode_all(replies[-1]))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), HEARTBEAT_INTERVAL_S)

    async def _listen(self) -> None:
        """The pub/sub listener, subscribed again whenever the set of loaded models changes."""
        while True:
            self._models_changed.clear()
            names = frozenset(self.served.queues if self.served is not None else ())
            self._listened = names
            listening = asyncio.create_task(
                self._listen_for_cancellations(names)
                if names or self.explicit
                else self._until_stopped()
            )
            changed = asyncio.create_task(self._models_changed.wait())
            done, _ = await asyncio.wait({listening, changed}, return_when=asyncio.FIRST_COMPLETED)
            await stop_tasks([listening, changed])
            if listening in done and listening.exception() is not None:
                raise listening.exception()  # type: ignore[misc]

    async def _listen_for_cancellations(self, names: frozenset[str]) -> None:
        """Gateways publish the ids of requests whose client went away; drop those not started.
        In explicit mode the same connection hears the nudges of new desired states."""
        by_channel = {keys.cancel_channel(name).encode(): name for name in names}
        channels = [*by_channel, *([keys.DESIRED_CHANNEL.encode()] if self.explicit else [])]
        client = async_client(self.config.redis_url, socket_timeout_s=None)
        backoff = Backoff.doubling(RESUBSCRIBE_FIRST_S, RESUBSCRIBE_MAX_S)
        try:
            while True:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                try:
                    await pubsub.subscribe(*channels)
                    backoff.reset()
                    async for message in pubsub.listen():
                        if message["type"] != "message":
                            continue
                        name = by_channel.get(message["channel"])
                        queue = self.served.queues.get(name) if name and self.served else None
                        if queue is not None:
                            queue.cancel(message["data"].decode())
                        elif name is None:  # a desired-state nudge: read it with a beat now
                            self._beat_now.set()
                except REDIS_ERRORS as exc:
                    log.warning("cancellation channel lost (%s); resubscribing", exc)
                    await asyncio.sleep(backoff.next_s())
                finally:
                    await pubsub.aclose()
        finally:
            await client.aclose()

    async def _until_stopped(self) -> None:
        await self._stopped.wait()

    def stop(self) -> None:
        log.info("worker %s stopping: finishing the batches in hand", self.id)
        self._stopped.set()
        if self.served is not None:
            self.served.stop()

    def ready(self) -> bool:
        """Serving (some model loaded, or none needed: explicit and poll modes), Redis reached,
        and no queue's read or recovery loop, nor a helper loop, down after a failure."""
        queues = self.queues
        serving = bool(queues) or self.config.model_control_mode != "none"
        return serving and self.redis_ok and self.helpers.up and all(q.up for q in queues)

    async def _startup_models(
        self, manager: ModelManager
    ) -> tuple[set[str] | None, dict[str, DesiredModel]]:
        """The models to load before serving (None: every one), and the desired states to
        follow once serving: explicit mode loads `--load-model`'s models unless a load or
        unload through the API since says otherwise."""
        if not self.explicit:
            return None, {}
        try:
            desired = await read_desired(self.redis)
        except REDIS_ERRORS as exc:  # followed on the first heartbeat that reaches Redis
            log.warning("desired model states not read (%s); following them later", exc)
            desired = {}
        wanted = self.config.load_model
        names = set(manager.scope()) if ALL_MODELS in wanted else set(wanted)
        return names - set(desired), desired

    async def run(self) -> None:
        await initialized(self.redis)  # before the model queues share it
        health = None
        if self.config.health_port is not None:
            health = await serve_health(self.config.host, self.config.health_port, self.ready)
        served = self.served = ServedModels(
            self.config.model_repository,
            self.id,
            self.redis,
            self._new_queue,
            self._changed,
            OverrideDirectory(self.id),
            complete=complete_config,
        )
        manager = self.manager = ModelManager(served, self.config.models)
        only, desired = await self._startup_models(manager)
        await served.start(await asyncio.to_thread(served.scan_at_start, self.config.models, only))
        manager.follow(desired)
        settle_after_startup()
        on_stop_signals(self.drain, asyncio.get_running_loop(), self.stop)
        self.sampler.start()
        helpers = self.helpers
        helpers.start("heartbeat", self._heartbeat)
        helpers.start("cancellations", self._listen)
        helpers.start("log-settings", lambda: process_control().follow(self.redis))
        if self.config.model_control_mode == "poll":
            helpers.start("repository-poll", lambda: manager.poll(self.config.repository_poll_secs))
        stopped = asyncio.create_task(self._until_stopped())
        try:
            if not self.queues and self.config.model_control_mode == "none":
                log.error("no model could be loaded; waiting for a signal")
            ended: set[asyncio.Future[None]] = {stopped, served.failed}
            await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
            if served.failed.done():
                served.failed.result()  # a queue failed: exit with its error, as before
            await manager.wait_stopped()
        finally:
            await helpers.stop()
            await stop_tasks([stopped])
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
            if self.exporting is not None:
                await asyncio.to_thread(self.exporting.close)  # its last spans go out


def _served(manager: ModelManager | None) -> list[tuple[str, dict[str, Any], list[int]]]:
    """(name, config, versions) of each model and ensemble served here, as last loaded."""
    if manager is None:
        return []
    served = [
        (name, queue.spec.config_json, sorted(queue.instances.by_version))
        for name, queue in manager.served.queues.items()
    ] + [
        (name, entry.spec.config_json, list(entry.versions))
        for name, entry in manager.served.ensembles.items()
        if entry.spec is not None
    ]
    return [s for s in served if manager.announces(s[0])]  # else a newer load applies here


def _usage(queues: list[ModelQueue]) -> dict[str, Any]:
    """The heartbeat's view of the queues: devices, instances, and sequences running/waiting
    (an iterative model's; a sequence model's holding a slot, or waiting in the backlog)."""
    return {
        "devices": sorted({str(q.instances.device) for q in queues}),
        "instances": {
            q.spec.name: sum(len(lanes) for lanes in q.instances.by_version.values())
            for q in queues
        },
        SEQUENCES: {
            **{
                q.spec.name: [q.inflight.stats.running, q.inflight.stats.waiting]
                for q in queues
                if q.inflight is not None
            },
            **{
                q.spec.name: [len(q.sequences.batcher.slotted), len(q.sequences.batcher.backlog)]
                for q in queues
                if q.sequences is not None
            },
        },
    }


def _in_hand(queues: list[ModelQueue]) -> str:
    """What a cut-short drain leaves: the requests stay pending in their streams, where
    another worker takes them over after --claim-idle-ms."""
    busy = [
        f"{q.spec.name}: {q.state.busy_lanes} batches running, "
        f"{len(q.state.pending)} requests waiting"
        for q in queues
        if q.state.in_hand
    ]
    if not busy:
        return ""
    return "; ".join(busy) + " (left pending in Redis for another worker to take over)"


def run_worker(config: WorkerConfig) -> None:
    """Entry point of `sluice worker`."""
    uvloop.run(Worker(config).run())
