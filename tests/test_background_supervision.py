"""The background loops of a gateway (reply reader, model table) and of a worker's model queue
(read loop, recovery) against a real Redis: a bug that raises in one is logged with its
traceback, fails what waits on it, makes the process not ready, and the loop runs again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from sluice.gateway.background import start_background
from sluice.gateway.dispatcher import Dispatcher
from sluice.gateway.model_table import ModelTable
from sluice.gateway.outbox import Route
from sluice.gateway.replies import ReplyReader
from sluice.shared import keys
from sluice.shared.errors import Unavailable
from sluice.shared.protocol import Request, Result, Tensor, encode_requests, encode_results
from sluice.shared.redis_client import async_client
from sluice.shared.registry import Member, now_ms
from sluice.shared.supervision import Supervisor
from sluice.workers.batching.model_queue import ModelQueue
from sluice.workers.batching.reader import StreamReader
from sluice.workers.instances.stacked import StackedInstance
from sluice.workers.recovery.recovery import RecoveryPolicy
from sluice.workers.recovery.takeover import Takeover
from sluice.workers.worker import Worker

from sluice.settings import WorkerSettings
from tests.batch_loop_harness import add_model
from tests.restart_gate import Gate
from tests.streams import collect_results, int_request


class Bug(RuntimeError):
    """What the test makes a loop raise, once."""


def raise_once(monkeypatch: pytest.MonkeyPatch, owner: type, method: str) -> asyncio.Event:
    """`owner.method` raises Bug on its next call, then works again; the event says it raised."""
    real = getattr(owner, method)
    raised = asyncio.Event()

    def failing(*args: Any, **kwargs: Any) -> Any:
        if not raised.is_set():
            raised.set()
            raise Bug(f"a bug in {method}")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, method, failing)
    return raised


def logged_bug(caplog: pytest.LogCaptureFixture, name: str) -> bool:
    """Whether the loop `name` failed with a Bug, logged with its traceback (a read loop's
    comes in the ExceptionGroup of its partitions' loops)."""
    for record in caplog.records:
        if record.levelno == logging.ERROR and f"{name} failed" in record.getMessage():
            assert record.exc_info is not None
            exc = record.exc_info[1]
            if isinstance(exc, BaseExceptionGroup):
                return exc.subgroup(Bug) is not None
            return isinstance(exc, Bug)
    return False


class Gateway:
    """A gateway's dispatcher and model table with their loops supervised, as serve runs them."""

    def __init__(self, url: str) -> None:
        self.redis = async_client(url)
        self.reader = async_client(url, socket_timeout_s=None)
        self.dispatcher = Dispatcher(self.redis, self.reader, "gw-supervised")
        self.gate = Gate()
        self.supervisor = Supervisor(sleep=self.gate)
        self.table = ModelTable(
            self.redis,
            "gw-supervised",
            self.dispatcher.inflight_snapshot,
            control_mode="explicit",  # ready with a worker and no model
            background_up=lambda: self.supervisor.up,
        )

    async def start(self) -> None:
        worker = Member("w", "worker", "h", 1, now_ms())
        await self.redis.hset(keys.FLEET, "w", worker.encode())
        start_background(self.dispatcher, self.table, self.supervisor)
        while not self.table.ready:
            self.table.refreshed.clear()
            await self.table.refreshed.wait()

    async def close(self) -> None:
        await self.supervisor.stop()
        await self.dispatcher.close()
        await self.redis.aclose()
        await self.reader.aclose()

    def request(self) -> Request:
        d = self.dispatcher
        return Request(d.new_request_id(), 1, 0, d.reply_stream, [Tensor("IN", "INT8", (1,), b"")])

    async def answered(self, request: Request) -> Result:
        """Send `request` and answer it as a worker would."""
        waiting = asyncio.create_task(self.dispatcher.submit(Route("m"), request, 30))
        while request.id not in self.dispatcher.waiting:
            await asyncio.sleep(0)
        await self.redis.xadd(self.dispatcher.reply_stream, encode_results([Result(request.id)]))
        return await waiting


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[Gateway]:
    gw = Gateway(redis_url)
    await gw.start()
    yield gw
    await gw.close()


async def test_a_failed_reply_reader_fails_its_waiters_and_reads_again(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    raised = raise_once(monkeypatch, ReplyReader, "_resolve")
    with pytest.raises(Unavailable, match="reply reader failed") as failed:
        await gateway.answered(gateway.request())  # its answer crashes the reader
    assert "Bug: a bug in _resolve" in failed.value.message
    assert raised.is_set() and logged_bug(caplog, "replies")
    await gateway.gate.asleep.wait()
    assert not gateway.table.ready  # /v2/health/ready: 400 while no reply is read
    gateway.gate.open()
    again = gateway.request()
    assert (await gateway.answered(again)).id == again.id
    assert gateway.table.ready


async def test_a_failed_model_table_refresh_runs_again(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    raise_once(monkeypatch, ModelTable, "_observe_partitions")
    await gateway.gate.asleep.wait()
    assert logged_bug(caplog, "model-table")
    assert not gateway.table.ready
    gateway.table.refreshed.clear()
    gateway.gate.open()
    await gateway.table.refreshed.wait()
    assert gateway.table.ready


def plus_one(inputs: dict[str, Any]) -> dict[str, Any]:
    return {"OUT": inputs["IN"] + 1}


@dataclass
class Served:
    queue: ModelQueue
    gate: Gate
    #: a worker whose one queue is `queue`, its heartbeat through.
    worker: Worker

    async def down_then_up(self, name: str, caplog: pytest.LogCaptureFixture) -> None:
        """The loop `name` failed: logged, the worker not ready until it runs again."""
        await self.gate.asleep.wait()
        assert logged_bug(caplog, name)
        assert not self.worker.ready()  # its /v2/health/ready: 503
        self.gate.open()
        while not self.queue.up:
            await asyncio.sleep(0)
        assert self.worker.ready()


@pytest.fixture
async def served(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Served]:
    """The "add" model's queue, which takes a read entry over once it idled 300 ms."""
    redis_client = async_client(redis_url)
    reader = async_client(redis_url, socket_timeout_s=None)
    spec, cpu = add_model(tmp_path), torch.device("cpu")
    model_queue = ModelQueue(
        spec,
        {1: [StackedInstance(spec, plus_one, cpu)]},
        cpu,
        redis_client,
        reader,
        "c1",
        block_ms=100,
        recovery=RecoveryPolicy(claim_idle_ms=300),
    )
    gate = Gate()
    model_queue.background = Supervisor(sleep=gate)
    worker = Worker(WorkerSettings(model_repository=tmp_path, redis_url=redis_url).config())
    monkeypatch.setattr(Worker, "queues", property(lambda _: [model_queue]))
    worker.redis_ok = True
    assert worker.ready()
    running = asyncio.create_task(model_queue.run())
    yield Served(model_queue, gate, worker)
    model_queue.stop()
    await running
    await worker.redis.aclose()
    await redis_client.aclose()
    await reader.aclose()


def send(redis_url: str, value: int) -> tuple[str, int]:
    """Queue a request for `value` on the "add" model; its answer (id, output)."""
    client = redis.Redis.from_url(redis_url)
    reply_to = f"replies:{value}"
    try:
        request = int_request(value, reply_to)
        client.xadd(keys.request_stream("add"), encode_requests([request]))
        (answer,) = collect_results(client, reply_to, 1)
        return answer
    finally:
        client.close()


async def test_a_failed_read_loop_reads_again_and_its_entry_is_taken_over(
    served: Served,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    raise_once(monkeypatch, StreamReader, "_admit")
    answers = asyncio.create_task(asyncio.to_thread(send, redis_url, 1))
    await served.down_then_up("read:add", caplog)
    # the entry read when the loop failed is pending on this consumer: recovery runs it
    assert await answers == ("r1", 2)
    assert await asyncio.to_thread(send, redis_url, 2) == ("r2", 3)


async def test_a_failed_recovery_round_runs_again(
    served: Served,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    raise_once(monkeypatch, Takeover, "_take_over")
    await served.down_then_up("recover:add", caplog)
    assert await asyncio.to_thread(send, redis_url, 3) == ("r3", 4)
