"""A lone batch run while its delay runs out, answered only once the batcher forms that batch.

Under Triton's fixed delay a request that arrives alone waits `max_queue_delay_microseconds`
and only then runs, so at low load its latency is the delay plus the run. When no request
joined the model's last partial batches while they waited (one client in a closed loop, a
quiet model), the batch the delay will release is run at once on a free instance and its
outputs are held. When the delay is out the batch loop decides exactly as it always does: if
it takes exactly those requests, the held run answers them; if one joined, left or timed out
meanwhile, the run is dropped and the batch runs as usual.

No batch is formed differently, and no answer goes out before its batch is formed: the run
only overlaps the wait. A dropped run costs its compute, and the batch formed instead may wait
for the instance as for any busy one: hence runs are made only after many waits in a row
that no request joined, which the loop learns from every partial batch that waited, run early
or not. A model whose run may have effects of its own (a Triton Python model) or that answers
through response streams is never run early.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from sluice.workers.batching.pending import Queued
from sluice.workers.batching.queue_state import QueueState
from sluice.workers.instances.lanes import Instances
from sluice.workers.instances.model_instance import BatchOutputs

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Early:
    """A run started before its batch was formed."""

    ids: tuple[str, ...]
    #: wall time the run started (the batch's start, for its queue time).
    started_ns: int
    running: asyncio.Future[BatchOutputs]


def _ids(batch: list[Queued]) -> tuple[str, ...]:
    return tuple(q.request.id for q in batch)


class EarlyRuns:
    """At most one early run of one model queue, held until its batch is formed or dropped."""

    #: early runs are made after this many partial batches in a row left the wait as they
    #: entered it: where requests come at random, a join is then rare enough that a dropped
    #: run (and the batch it holds up) stays out of the latency's tail.
    QUIET_WAITS = 50

    def __init__(self, state: QueueState, instances: Instances, enabled: bool) -> None:
        self.state = state
        self.instances = instances
        self.enabled = enabled
        #: partial batches in a row that left the wait as they entered it (none joined, left
        #: or timed out).
        self.quiet = 0
        #: the batch the current wait will release if nothing changes (None: no wait noted).
        self._expected: tuple[str, ...] | None = None
        self._held: Early | None = None
        #: runs that answered their batch, and runs dropped because the batch came out otherwise.
        self.used = 0
        self.dropped = 0

    def worth_starting(self) -> bool:
        """No request joined the last waits, a lane is free and the model's runs are timed (a
        Triton Python model's are not)."""
        return (
            self.enabled
            and self.quiet >= self.QUIET_WAITS
            and bool(self.state.free_lanes)
            and self.instances.last_run_ns is not None
        )

    def waiting(self) -> None:
        """Nothing is due: note the batch the delay will release, and run it now if that is
        worth it."""
        if not self.enabled or self._expected is not None:
            return
        batch = self.state.batch_when_due()
        if not batch:
            return
        self._expected = _ids(batch)
        if self.worth_starting():
            self._start(batch)

    def _start(self, batch: list[Queued]) -> None:
        lane = self.state.lane_lent()
        requests = [q.request for q in batch]
        sizes = [q.pending.batch_size for q in batch]
        started_ns = time.time_ns()
        running = self.instances.start(lane, requests, sizes)
        self._held = Early(_ids(batch), started_ns, running)
        running.add_done_callback(lambda done: self._ended(lane, done))

    def claim(self, batch: list[Queued]) -> tuple[Early | None, bool]:
        """A batch was formed: the held run if it ran exactly `batch`, and whether a held run
        of other requests was dropped instead."""
        ids = _ids(batch)
        expected, self._expected = self._expected, None
        if expected is not None:
            self.quiet = self.quiet + 1 if expected == ids else 0
        held, self._held = self._held, None
        if held is None:
            return None, False
        if held.ids == ids:
            self.used += 1
            return held, False
        self.dropped += 1
        return None, True

    def _ended(self, lane: int, done: asyncio.Future[BatchOutputs]) -> None:
        if not done.cancelled():
            done.exception()  # a dropped run's failure is nobody's; a claimed one's is re-raised
        self.state.batch_finished(lane)

    def report(self, model: str) -> None:
        if self.used or self.dropped:
            log.info("%s: %d early runs answered, %d dropped", model, self.used, self.dropped)
