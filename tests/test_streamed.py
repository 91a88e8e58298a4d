"""workers/answers/streamed.py: a request's responses numbered and published in the order sent, from
any thread, many to a round trip; nothing after the final one; cancellation seen by the model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from sluice.shared.errors import InvalidInput
from sluice.shared.model_config import load_model_config
from sluice.shared.protocol import Request, Result
from sluice.workers.answers.streamed import ResponseStream, StreamClosed
from sluice.workers.batching.batcher import Pending
from sluice.workers.batching.pending import Queued

from tests.conftest import HERE


class Published:
    """The publisher's side: what each round trip carried."""

    def __init__(self) -> None:
        self.calls: list[list[Result]] = []

    async def publish(self, items: Sequence[Queued], results: Sequence[Result]) -> None:
        assert [q.request.id for q in items] == [r.id for r in results]
        self.calls.append(list(results))

    @property
    def results(self) -> list[Result]:
        return [r for call in self.calls for r in call]


def _stream() -> tuple[ResponseStream, Published]:
    spec = load_model_config(HERE / "decoupled_repo" / "repeat")
    published = Published()
    return ResponseStream(published, spec), published  # type: ignore[arg-type]


def _item(request_id: str, outputs: tuple[str, ...] | None = None) -> Queued:
    request = Request(request_id, 1, 0, "replies", [], outputs)
    return Queued(request, "s", b"1-0", Pending(1, 1, 0))


async def test_responses_from_threads_keep_their_order_and_numbers() -> None:
    stream, published = _stream()
    items = [_item("a"), _item("b")]
    stream.open(items)

    def model(item: Queued, count: int) -> None:
        for i in range(count):
            stream.send(item.request, {"OUT": np.array([i], np.int32)})
        stream.send(item.request, final=True)

    threads = [threading.Thread(target=model, args=(q, 50)) for q in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    await asyncio.wait_for(stream.wait_closed(), 10)
    for request_id in "ab":
        mine = [r for r in published.results if r.id == request_id]
        assert [r.seq for r in mine] == list(range(51))
        assert [r.final for r in mine] == [False] * 50 + [True]
        values = [np.frombuffer(r.outputs[0].data, np.int32)[0] for r in mine[:50]]
        assert values == list(range(50)) and mine[50].outputs == []
    assert len(published.calls) < 102  # many responses to a round trip


async def test_outputs_are_the_requested_ones_as_the_configs_types() -> None:
    stream, published = _stream()
    item = _item("r", outputs=("IDX",))
    stream.open([item])
    outputs = {"OUT": torch.tensor([1]), "IDX": torch.tensor([7], dtype=torch.int64)}
    stream.send(item.request, outputs, final=True)
    await stream.wait_closed()
    (result,) = published.results
    (idx,) = result.outputs
    assert (idx.name, idx.datatype, idx.shape, bytes(idx.data)) == (
        "IDX",
        "UINT32",
        (1,),
        np.array([7], np.uint32).tobytes(),
    )


async def test_nothing_after_the_final_response() -> None:
    stream, published = _stream()
    item = _item("r")
    stream.open([item])
    stream.send(item.request, error=InvalidInput("bad"), final=True)
    with pytest.raises(StreamClosed):
        stream.send(item.request, final=True)
    assert not stream.end(item.request, InvalidInput("late"))
    with pytest.raises(StreamClosed):
        stream.send(_item("never opened").request, final=True)
    await stream.wait_closed()
    assert [(r.seq, r.error, r.final) for r in published.results] == [
        (0, ("INVALID_ARG", "bad"), True)
    ]


async def test_a_cancelled_request_is_seen_until_its_final_response() -> None:
    stream, _ = _stream()
    item = _item("r")
    assert not stream.cancel("r")  # not open here
    stream.open([item])
    assert stream.cancel("r") and stream.is_cancelled("r")
    assert stream.end(item.request, InvalidInput("stopped"))
    assert not stream.is_open("r") and not stream.is_cancelled("r")
    await stream.wait_closed()
