"""Answering: results to each gateway's reply stream, then ack + delete + statistics.

An ensemble step's result goes on instead (workers/answers/ensemble_steps.py): its commands lead
the same pipeline, so they reach Redis before the step's entry is acknowledged.

One pipeline per batch: an XADD per gateway with requests in the batch, then, per request
stream involved, an XACK and an XDEL of the fully answered entries; a batch that also lowers a
queue-size counter or carries a statistics record calls the script that does all of it instead
(see shared/stats.py).

Results outlive a Redis outage: a batch finished while Redis is unreachable keeps its
encoded results and publishes them (and acks) once Redis is back, so nothing is computed twice
and nothing is lost; gateways resolve each request once, should it also run elsewhere.

A batch's statistics go with its own ack when the worker has nothing else in hand, so they
are in Redis by the time its last client has its answer. Under load they are summed over
the batches published within `STATS_FLUSH_S` and written with one of their acks, so that
their record (and its folding in) costs less per inference as batches come faster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from sluice.shared import keys
from sluice.shared.backoff import Backoff
from sluice.shared.protocol import Result, encode_results, job_event
from sluice.shared.redis_client import (
    CONNECTION_ERRORS,
    REDIS_ERRORS,
    UNREACHABLE_RETRY_DELAYS_S,
    out_of_memory,
)
from sluice.shared.redis_wire import Command, Wire, xadd
from sluice.shared.stats import FINISH_BATCH, add_increments, stats_record
from sluice.workers.answers.ensemble_steps import Outgoing, continue_steps
from sluice.workers.answers.refused_results import REFUSED, answer_command, refused_answers
from sluice.workers.batching.pending import Queued

log = logging.getLogger(__name__)

#: safety cap on a gateway's reply stream, should that gateway stop trimming it.
REPLY_STREAM_MAXLEN = 10_000
#: statistics of batches published while more work is in hand wait at most this long.
STATS_FLUSH_S = 0.1

EntryKey = tuple[str, bytes]


def _refused_for_memory(reply: Any) -> bool:
    return isinstance(reply, Exception) and out_of_memory(reply)


class Publisher:
    def __init__(
        self,
        redis: aioredis.Redis,
        model: str,
        counted_levels: set[int],
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.model = model
        #: levels with a max_queue_size, whose queue-size counter gateways raise.
        self.counted_levels = counted_levels
        #: (stream, entry id) -> requests of that entry not yet answered.
        self.unanswered: dict[EntryKey, int] = {}
        #: answered entries whose acks wait for Redis to come back: still ours to keep alive.
        self.unacked: dict[EntryKey, None] = {}
        self._wire = Wire(redis)
        self._clock_s = clock_s
        #: statistics not yet written: field -> increment (`last_inference` fields: latest).
        self._unwritten: dict[str, int] = {}
        self._unwritten_since_s = 0.0

    def hold(self, stream: str, entry_id: bytes, requests: int) -> None:
        self.unanswered[(stream, entry_id)] = requests

    def held(self, stream: str) -> list[bytes]:
        return [entry_id for s, entry_id in (*self.unanswered, *self.unacked) if s == stream]

    def _settle(
        self, items: Sequence[Queued], results: Sequence[Result], extra_acks: Sequence[EntryKey]
    ) -> dict[str, list[bytes]]:
        done: dict[str, list[bytes]] = defaultdict(list)
        for stream, entry_id in extra_acks:
            self.unanswered.pop((stream, entry_id), None)
            done[stream].append(entry_id)
        for item, result in zip(items, results, strict=True):
            if not result.final:  # a streamed response: its request is answered by the last
                continue
            key = (item.stream, item.entry_id)
            left = self.unanswered.get(key, 1) - 1
            if left > 0:
                self.unanswered[key] = left
            else:
                self.unanswered.pop(key, None)
                done[item.stream].append(item.entry_id)
        return done

    def _statistics(self, increments: Sequence[str | int], defer: bool) -> list[bytes]:
        """The record to write now: `increments` plus any held back (none if they may wait)."""
        if not self._unwritten:
            if not increments:
                return []
            if not defer:  # nothing held back: this batch's own record
                return [stats_record(increments)]
            self._unwritten_since_s = self._clock_s()
        held = self._unwritten
        add_increments(held, increments)
        if defer and self._clock_s() - self._unwritten_since_s < STATS_FLUSH_S:
            return []
        self._unwritten = {}
        return [stats_record([x for pair in held.items() for x in pair])]

    async def publish(
        self,
        items: Sequence[Queued],
        results: Sequence[Result],
        stat_increments: Sequence[str | int] = (),
        extra_acks: Sequence[EntryKey] = (),
        defer_statistics: bool = False,
    ) -> None:
        """Reply to each gateway, then ack the fully answered entries, in one round trip. A
        streamed response that is not final (workers/answers/streamed.py) answers nothing yet.

        `defer_statistics`: more work is in hand, so the statistics may join a later call's.
        """
        records = self._statistics(stat_increments, defer_statistics)
        by_route: dict[str, list[Result]] = defaultdict(list)
        answered: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        steps = []
        for item, result in zip(items, results, strict=True):
            if item.request.continuation is not None:  # an ensemble step: it goes on
                steps.append((item.request, result))
            else:
                by_route[item.request.reply_to].append(result)
                if item.level in self.counted_levels and result.final:  # steps are not counted
                    answered[item.stream][item.level] += 1
        done = self._settle(items, results, extra_acks)
        streams = set(done) | set(answered)
        if not streams and records:
            streams = {keys.request_stream(self.model)}
        finish: list[Command] = []
        for index, stream in enumerate(sorted(streams)):
            ids = done.get(stream, [])
            ((level, count),) = answered[stream].items() if answered.get(stream) else ((0, 0),)
            finish += self._finish(stream, ids, level, count, records if index == 0 else [])
        onward = await continue_steps(self._wire, steps, REPLY_STREAM_MAXLEN) if steps else []
        await self._send(by_route, finish, len(results), done, onward)

    @property
    def holds_statistics(self) -> bool:
        """Statistics were held back for a later batch's (see `publish`'s `defer_statistics`)."""
        return bool(self._unwritten)

    async def forwarded(self, items: Sequence[Queued]) -> None:
        """Requests sent on to another stream, whose reader answers them (a sequence's, to
        the worker that owns it): their entries are acked once all their requests were."""
        done = self._settle(items, [Result(q.request.id) for q in items], ())
        finish = [c for stream, ids in done.items() for c in self._finish(stream, ids, 0, 0, [])]
        if finish:
            await self._wire.execute(*finish)

    def _finish(
        self, stream: str, ids: list[bytes], level: int, answered: int, records: list[bytes]
    ) -> list[Command]:
        """What finishes a batch on one request stream. Most batches under load carry no
        statistics record (it waits up to STATS_FLUSH_S to go with a later batch's) and lower
        no queue-size counter: for those a plain XACK and XDEL do, at a fraction of the script
        call's Redis CPU (benchmarks/redis_cost.py)."""
        if answered or records:
            partition = keys.partition_of(stream)  # its keys share the stream's slot
            script_keys = [
                stream,
                keys.model_stats(self.model, partition),
                keys.queue_sizes(self.model, partition),
                keys.model_stats_log(self.model, partition),
            ]
            args = [keys.WORKER_GROUP, len(ids), *ids, level, answered, *records]
            return [FINISH_BATCH.command(script_keys, args)]
        if not ids:
            return []
        return [("XACK", stream, keys.WORKER_GROUP, *ids), ("XDEL", stream, *ids)]

    async def close(self) -> None:
        await self._wire.close()

    async def _announce_jobs(self, by_route: dict[str, list[Result]]) -> None:
        """Asynchronous jobs among the routes: announce each on its channel (after the result
        is stored, so a listener that hears it can read it). Not pipelined: cluster clients
        refuse PUBLISH in a pipeline, and jobs are the rare route."""
        for route, route_results in by_route.items():
            job_id = keys.job_of_stream(route)
            if job_id is None:
                continue
            last = route_results[-1]
            status = "done" if last.error is None else "failed"
            if not last.final:  # a streamed response: more are to come
                status = "running"
            try:
                await self.redis.publish(keys.job_channel(job_id), job_event(job_id, status))
            except REDIS_ERRORS as exc:  # the result is stored; only the notification is lost
                log.warning("job %s: could not announce it: %s", job_id, exc)

    async def _send(
        self,
        by_route: dict[str, list[Result]],
        finish: list[Command],
        count: int,
        done: dict[str, list[bytes]],
        onward: list[Outgoing],
    ) -> None:
        commands = [outgoing.command for outgoing in onward] + [
            xadd(route, encode_results(route_results), "MAXLEN", "~", REPLY_STREAM_MAXLEN)
            for route, route_results in by_route.items()
        ]
        commands += finish
        backoff: Backoff | None = None  # made on a first failure: none per healthy batch
        while True:
            try:
                replies = await self._wire.execute(*commands, raise_on_error=False)
            except CONNECTION_ERRORS as exc:
                if backoff is None:
                    log.warning(
                        "%s: Redis unreachable (%s): keeping %d results until it is back",
                        *(self.model, exc, count),
                    )
                    unacked = [(stream, i) for stream, ids in done.items() for i in ids]
                    self.unacked.update(dict.fromkeys(unacked))
                    backoff = Backoff(UNREACHABLE_RETRY_DELAYS_S)
                await asyncio.sleep(backoff.next_s())
                continue
            if backoff is not None:
                log.info("%s: published %d results kept through a Redis outage", self.model, count)
                for stream, ids in done.items():
                    for entry_id in ids:
                        self.unacked.pop((stream, entry_id), None)
            error = await self._answer_refused(by_route, replies, onward)
            await self._announce_jobs(by_route)
            if error is not None:
                raise error
            return

    async def _answer_refused(
        self, by_route: dict[str, list[Result]], replies: list[Any], onward: list[Outgoing]
    ) -> Exception | None:
        """Answer each request whose result (or next ensemble step) Redis refused for memory
        with an error instead (workers/answers/refused_results.py); the first other error reply,
        which the caller raises."""
        waiting: dict[str, list[str]] = defaultdict(list)
        for index, outgoing in enumerate(onward):
            if _refused_for_memory(replies[index]):
                for route, request_id in outgoing.waiting:
                    waiting[route].append(request_id)
                replies[index] = None
        for index, route in enumerate(list(by_route), len(onward)):
            if _refused_for_memory(replies[index]):
                ids = [result.id for result in by_route[route]]
                waiting[route] += ids
                by_route[route] = refused_answers(ids)
                replies[index] = None
        calls = [
            answer_command(route, refused_answers(ids), REPLY_STREAM_MAXLEN)
            for route, ids in waiting.items()
        ]
        if calls:
            log.error("%s: %s (%d routes)", self.model, REFUSED, len(calls))
            try:
                await self._wire.execute(*calls)
            except REDIS_ERRORS as exc:
                log.error("%s: those errors could not be stored either (%s)", self.model, exc)
        return next((reply for reply in replies if isinstance(reply, Exception)), None)
