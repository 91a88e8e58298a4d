"""What one model queue holds and runs, and the events that change it.

The read, batch and answer loops share this one object and change it only through its
transitions, each named for the event that calls it. The conditions the loops wait on
(`may_read`, `may_launch`, `idle`, `finished`) are computed here, from the state, in one place;
the two events the loops sleep on follow from them after every transition:

- `room` is set while the reader may read (or must look up to see it is stopping);
- `wake` is set when the batch loop has something new to judge.

A FIFO model (one stream) reads ahead: it keeps one batch in hand while every instance is
busy, so the next batch is ready the moment an instance frees. A model with priority levels
reads only while an instance is free and catches up once more just before each batch, so a
request of a higher level arriving meanwhile is never stuck behind lower ones already in
hand. A batch run on the loop's own thread (`runs_inline`) is answered before the next read.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Final

from sluice.shared.errors import SluiceError
from sluice.workers.batching.batcher import (
    INLINE_RUN_LIMIT_NS,
    ArrivalGap,
    BatchRules,
    Send,
    Wait,
    next_batch,
    runs_inline,
)
from sluice.workers.batching.pending import PendingQueue, Queued


@dataclass(frozen=True, slots=True)
class Launch:
    """A batch taken out of the queue for an instance lane (`inline`: run on the loop)."""

    lane: int
    batch: list[Queued]
    inline: bool


class QueueState:
    """One model queue's requests in hand, its lanes, and where its loops stand."""

    def __init__(self, rules: BatchRules, instance_count: int, levels: int) -> None:
        self.rules = rules
        self.instance_count = instance_count
        #: a batch's worth of requests, counted in batch units (rows).
        self.capacity: Final = max(1, rules.max_batch_size)
        #: keep a batch in hand while the instances are busy (FIFO models only).
        self.reads_ahead: Final = levels == 1
        #: read but not started, in priority order.
        self.pending = PendingQueue()
        self.free_lanes = list(range(instance_count))
        #: gaps beyond twice the delay say no more about whether waiting would pay.
        self.arrivals = ArrivalGap(cap_ns=2 * rules.max_queue_delay_ns)
        #: the same gaps, capped far enough above a short run to compare with it.
        self.spacing = ArrivalGap(cap_ns=2 * INLINE_RUN_LIMIT_NS)
        self.stopping = False
        #: a batch run on the loop's thread is being answered: nothing is read until it is.
        self.answering_inline = False
        #: a lane freed since the batch loop last looked (read what queued up meanwhile).
        self.lane_freed_since_look = False
        self.batches_done = 0
        #: sequences an iterative model runs or holds (workers/generation/inflight_loop.py).
        self.sequences = 0
        self.room = asyncio.Event()
        self.wake = asyncio.Event()
        self._settle()

    # -- derived conditions ------------------------------------------------------------

    @property
    def busy_lanes(self) -> int:
        return self.instance_count - len(self.free_lanes)

    @property
    def may_read(self) -> bool:
        """Whether the reader may pull more: not stopping, not answering a run on the loop,
        an instance free (or reading ahead), and less than a batch in hand."""
        return (
            not self.stopping
            and not self.answering_inline
            and (bool(self.free_lanes) or self.reads_ahead)
            and self.pending.units() < self.capacity
        )

    @property
    def may_launch(self) -> bool:
        return bool(self.free_lanes) and bool(self.pending)

    @property
    def idle(self) -> bool:
        """Nothing in hand and nothing running (idle polling may go on)."""
        return not self.pending and not self.busy_lanes and not self.sequences

    @property
    def in_hand(self) -> bool:
        return bool(self.pending) or bool(self.busy_lanes) or bool(self.sequences)

    @property
    def finished(self) -> bool:
        """Stopping and nothing left to start: the batch loop ends."""
        return self.stopping and not self.pending

    def _settle(self) -> None:
        if self.may_read or self.stopping:
            self.room.set()
        else:
            self.room.clear()

    # -- transitions -------------------------------------------------------------------

    def arrived(self, start_ns: int) -> None:
        """A request read from the streams started waiting at `start_ns`."""
        self.arrivals.observe(start_ns)
        self.spacing.observe(start_ns)

    def queued(self, item: Queued) -> None:
        """A read request passed its checks; `requests_read` settles after the reply."""
        self.pending.add(item)

    def requests_read(self) -> None:
        """A read (or a takeover) was queued: judge again, maybe read on."""
        self._settle()
        self.wake.set()

    def request_cancelled(self, request_id: str) -> Queued | None:
        """Its client left: the request, if it was in hand and not started."""
        item = self.pending.cancel(request_id)
        if item is not None:
            self._settle()
        return item

    def expired(self, now_ns: int) -> list[tuple[Queued, SluiceError, str]]:
        """Requests past their deadline or timeout leave the queue (see `PendingQueue.expire`)."""
        expired = self.pending.expire(now_ns)
        self._settle()
        return expired

    def catch_up_count(self) -> int:
        """How many requests to read just before judging the next batch (0: no read).

        After a batch, the blocking reader may have handed over only the first request that
        arrived while every instance was busy; that one is already past its delay, so without
        this read it would run alone although others wait in the stream. A reading-ahead
        model has read them already.
        """
        due, self.lane_freed_since_look = self.lane_freed_since_look, False
        room = self.capacity - self.pending.units()
        if not due or self.reads_ahead or self.stopping or not self.pending:
            return 0
        return room if room > 0 and self.rules.dynamic else 0

    def decide(self, now_ns: int) -> Send | Wait:
        """The batch to launch now, or how long to sleep (capped by the next expiry).

        While stopping, what is in hand goes at once, oldest first.
        """
        decision = next_batch(self.pending.pendings(), now_ns, self.rules, self.arrivals.mean_ns)
        if isinstance(decision, Send):
            return decision
        if self.stopping:
            return Send((0,))
        wait_ns = decision.ns
        expiry_ns = self.pending.next_expiry_ns()
        if expiry_ns is not None:
            wait_ns = (
                max(0, expiry_ns - now_ns) if wait_ns is None else min(wait_ns, expiry_ns - now_ns)
            )
        return Wait(wait_ns)

    def full_batch(self, now_ns: int) -> list[Queued]:
        """The batch `decide` would launch now if it is full, so no request could join it
        before a lane frees (empty: none such); nothing is taken."""
        decision = self.decide(now_ns)
        if not isinstance(decision, Send):
            return []
        batch = [self.pending.items[i] for i in decision.indices]
        return batch if sum(q.pending.batch_size for q in batch) >= self.capacity else []

    def batch_when_due(self) -> list[Queued]:
        """The batch `decide` will launch once the first request's delay is out, if no
        request joins or leaves meanwhile; nothing is taken."""
        if not self.pending:
            return []
        pendings = self.pending.pendings()
        due_ns = pendings[0].start_ns + self.rules.max_queue_delay_ns
        decision = next_batch(pendings, due_ns, self.rules)
        if not isinstance(decision, Send):
            return []
        return [self.pending.items[i] for i in decision.indices]

    def lane_lent(self) -> int:
        """A free lane runs a batch not yet formed (`workers/batching/early_run.py`); it comes back
        through `batch_finished`."""
        lane = self.free_lanes.pop()
        self._settle()
        return lane

    def batch_launched(self, indices: tuple[int, ...], last_run_ns: int | None) -> Launch:
        """Take the batch for a free lane; it runs on the loop's thread when nothing else
        could use the loop meanwhile (`runs_inline`), and then nothing is read until it is
        answered."""
        lane = self.free_lanes.pop()
        batch = self.pending.take(indices)
        inline = runs_inline(
            self.instance_count, bool(self.pending), last_run_ns, self.spacing.mean_ns
        )
        self.answering_inline = inline
        self._settle()
        return Launch(lane, batch, inline)

    def lane_taken(self, lane: int) -> None:
        """A sequence model's batch runs on `lane`, the instance that holds its sequences'
        slots (workers/sequences/sequence_loop.py); it comes back through `batch_finished`."""
        self.free_lanes.remove(lane)
        self._settle()

    def batch_finished(self, lane: int) -> None:
        """A lane's thread is done with its batch: the lane may take the next one now,
        before this one is answered."""
        self._free(lane)

    def inline_answered(self, lane: int) -> None:
        """A batch run on the loop was answered (or failed to be): reading may go on."""
        self.answering_inline = False
        self._free(lane)

    def take_in_hand(self, count: int) -> list[Queued]:
        """An iterative model's instances take the first `count` requests in hand (in
        priority order) to run them as sequences: the reader may read on."""
        taken = self.pending.take(range(min(count, len(self.pending))))
        self._settle()
        return taken

    def sequences_running(self, count: int) -> None:
        """An iterative model's instances run or hold `count` sequences."""
        self.sequences = count

    def results_published(self) -> None:
        self.batches_done += 1

    def stop_requested(self) -> None:
        """Stop reading; what is in hand is still run and answered."""
        self.stopping = True
        self._settle()
        self.wake.set()

    def _free(self, lane: int) -> None:
        self.free_lanes.append(lane)
        self.lane_freed_since_look = True
        self._settle()
        self.wake.set()
