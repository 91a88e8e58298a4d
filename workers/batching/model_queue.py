"""One model's queue inside a worker: read from its streams, batch, run, publish, ack.

The parts, each in a module of its own, share one `QueueState` and change it only through its
transitions: `StreamReader` (reader.py) reads while the state has room, `Admission`
(admission.py) validates and queues what was read, `BatchLoop` (batch_loop.py) launches
batches as `next_batch` decides, `Answering` (answering.py) runs them and publishes the
results, and `Takeover` (takeover.py) keeps our entries claimed and takes over a dead
worker's. A model under Triton's sequence batcher reads only this worker's own sequence stream
and is batched by the sequence loop (workers/sequences/). How reading ahead, catching up and
running on the loop's thread play together is told in queue_state.py. The read and recovery
loops run under a supervisor (shared/supervision.py): one that fails is run again, and the
queue is not `up` meanwhile.
"""

from __future__ import annotations

import redis.asyncio as aioredis
import torch
from sluice.shared import keys
from sluice.shared.batch_delay import BatchDelay
from sluice.shared.idle_poll import DEFAULT_WINDOW_US, IdlePoll
from sluice.shared.model_config import ModelSpec
from sluice.shared.otel import Exporting
from sluice.shared.supervision import Supervisor
from sluice.workers.answers.publisher import Publisher
from sluice.workers.answers.streamed import ResponseStream
from sluice.workers.batching.admission import Admission
from sluice.workers.batching.answering import Answering
from sluice.workers.batching.batch_loop import BatchLoop
from sluice.workers.batching.batcher import BatchRules
from sluice.workers.batching.early_run import EarlyRuns
from sluice.workers.batching.queue_state import QueueState
from sluice.workers.batching.reader import StreamReader
from sluice.workers.batching.trace_spans import WorkerSpans
from sluice.workers.generation.inflight_loop import InflightLoop
from sluice.workers.instances.lanes import Instances
from sluice.workers.instances.model_instance import Capabilities, ModelInstance
from sluice.workers.recovery.recovery import Recovery, RecoveryPolicy
from sluice.workers.recovery.takeover import Takeover
from sluice.workers.sequences.ownership import SequenceOwnership
from sluice.workers.sequences.sequence_loop import SequenceLoop


def batch_rules(spec: ModelSpec, batch_delay: BatchDelay = "fixed") -> BatchRules:
    """The model's rules; its own BATCH_DELAY wins over the server's `batch_delay`."""
    policy = spec.batching
    return BatchRules(
        max_batch_size=spec.max_batch_size,
        dynamic=policy.dynamic,
        max_queue_delay_ns=policy.max_queue_delay_us * 1000,
        preferred_batch_sizes=frozenset(policy.preferred_batch_sizes),
        adaptive_delay=(policy.delay_mode or batch_delay) == "adaptive",
    )


class ModelQueue:
    """Serves one model's streams with `instance_count` concurrent instances per version."""

    def __init__(
        self,
        spec: ModelSpec,
        instances: dict[int, list[ModelInstance]],
        device: torch.device,
        redis: aioredis.Redis,
        reader: aioredis.Redis,
        consumer: str,
        block_ms: int = 1000,
        recovery: RecoveryPolicy | None = None,
        idle_poll_us: int = DEFAULT_WINDOW_US,
        batch_delay: BatchDelay = "fixed",
        early_run: bool = True,
        exporting: Exporting | None = None,
    ) -> None:
        self.spec = spec
        #: this queue's name in the streams' consumer group.
        self.consumer = consumer
        #: the blocking reads' own connection (closed by the worker).
        self.reader = reader
        policy = spec.config.queue_policy
        streams = {
            keys.request_stream(spec.name, lv, p): lv
            for p in range(spec.partitions)
            for lv in policy.levels
        }
        sequenced = spec.config.sequence_batched
        if sequenced:
            # the sequences this worker owns come to it on a stream of its own; a request put
            # on the model's streams (not by a gateway: a job, a BLS call) is sent on to its owner
            streams = {keys.sequence_stream(spec.name, consumer): 0, **streams}
        self.state = QueueState(
            batch_rules(spec, batch_delay), spec.instance_count, len(policy.levels)
        )
        counted = {lv for lv in policy.levels if policy.for_level(lv).max_queue_size}
        publisher = Publisher(redis, spec.name, counted)
        #: after a batch run on the loop (lone requests), poll for the next one
        self.idle_poll = IdlePoll(idle_poll_us * 1000, lambda: self.state.idle)
        capabilities = Capabilities.of_model(instances)
        #: a decoupled model's responses, where its instances answer each request themselves
        #: (None: one answer per request, with its batch).
        decoupled = spec.config.decoupled and capabilities.answers_each
        self.responses = ResponseStream(publisher, spec) if decoupled else None
        self.instances = Instances(spec, instances, device, self.responses)
        self.answering = Answering(
            publisher, self.instances, self.state, self.idle_poll, self.responses
        )
        if exporting is not None:  # --trace-config mode=opentelemetry
            self.answering.spans = WorkerSpans(exporting, spec.name)
        self.admission = Admission(spec, streams, self.instances, self.state, self.answering)
        self.reading = StreamReader(
            spec.name, redis, reader, consumer, block_ms, self.state, self.admission, self.answering
        )
        #: lone batches run as their delay runs out, where a run has no effects of its own.
        self.early = EarlyRuns(
            self.state,
            self.instances,
            early_run and capabilities.may_run_early and self.responses is None,
        )
        #: an iterative model with a generative contract: run by in-flight batching.
        self.inflight = (
            InflightLoop(spec, self.state, self.instances, self.answering, self.responses)
            if capabilities.generative and self.responses is not None
            else None
        )
        #: a model under Triton's sequence batcher: run by the sequence loop.
        self.sequences = (
            SequenceLoop(
                spec, self.state, self.answering, SequenceOwnership(redis, spec.name, consumer)
            )
            if sequenced
            else None
        )
        self.batching: BatchLoop | InflightLoop | SequenceLoop = (
            self.inflight
            or self.sequences
            or BatchLoop(self.state, self.instances, self.reading, self.answering, self.early)
        )
        recovery = recovery or RecoveryPolicy()
        recoveries = [Recovery(redis, spec.name, s, consumer, recovery) for s in streams]
        self.takeover = Takeover(spec.name, recoveries, self.state, self.admission, self.answering)
        #: runs the read and recovery loops again when they fail. An entry read by a failed
        #: read is pending on this consumer: recovery takes it over once it idled long enough.
        self.background = Supervisor()

    @property
    def streams(self) -> list[str]:
        """The model's request streams, one per priority level."""
        return list(self.admission.streams)

    @property
    def up(self) -> bool:
        """Its read and recovery loops run (the worker is not ready while one is down)."""
        return self.background.up

    @property
    def batches_done(self) -> int:
        return self.state.batches_done

    def stop(self) -> None:
        """Stop reading; requests already read are still run and answered."""
        self.state.stop_requested()

    def cancel(self, request_id: str) -> None:
        """Its client went away: drop the request if it has not started, or when it is read."""
        item = self.state.request_cancelled(request_id)
        if item is None and self.responses is not None and self.responses.cancel(request_id):
            return  # running: its model sees it cancelled, and still ends it
        if item is None:
            self.admission.remember_cancelled(request_id)
        else:
            self.answering.spawn(self.answering.drop_cancelled(item))

    async def run(self) -> None:
        if not await self.reading.join_groups():
            self.instances.shutdown()
            return
        self.background.start(f"read:{self.spec.name}", self.reading.run)
        self.background.start(f"recover:{self.spec.name}", self.takeover.run)
        if self.sequences is not None:
            self.background.start(f"sequences:{self.spec.name}", self.sequences.keep_ownership)
        try:
            await self.batching.run()
        finally:
            await self.background.stop()
            await self.answering.drain()
            if self.responses is not None:
                await self.responses.wait_closed()
            self.idle_poll.stop()
            self.instances.shutdown()
            self.early.report(self.spec.name)
            await self.reading.close()
            await self.answering.publisher.close()
