"""A worker keeps one batch in hand beyond the running one, and answers everything it pulled."""

from __future__ import annotations

import contextlib
from pathlib import Path

import redis
from sluice.shared import keys
from sluice.shared.protocol import encode_requests

from tests.conftest import wait_until
from tests.streams import (
    collect_results,
    int_request,
    request_stream,
    running_worker,
    write_gated_repo,
)

MAX_BATCH = 4
REQUESTS = 40


def _delivered(client: redis.Redis, stream: str) -> int:
    return int(client.xpending(stream, keys.WORKER_GROUP)["pending"])


def test_worker_reads_one_batch_ahead_while_its_instance_is_busy(
    tmp_path: Path, redis_url: str
) -> None:
    repo = write_gated_repo(tmp_path, MAX_BATCH)
    client = redis.Redis.from_url(redis_url)
    reply_to = keys.reply_stream("test")
    stream = request_stream()
    for i in range(REQUESTS):
        client.xadd(stream, encode_requests([int_request(i, reply_to)]))
    with running_worker(repo, redis_url), contextlib.closing(client):
        _, first = client.blpop("entered", timeout=60)
        assert int(first) == MAX_BATCH
        # the instance is held: the next batch is read ahead, and nothing beyond it
        wait_until(lambda: _delivered(client, stream) >= 2 * MAX_BATCH, "the read-ahead")
        assert _delivered(client, stream) == 2 * MAX_BATCH
        assert client.xlen(stream) == REQUESTS  # nothing acknowledged while the batch is held
        client.rpush("gate", *range(REQUESTS))
        results = dict(collect_results(client, reply_to, REQUESTS))
        assert results == {f"r{i}": i + 1 for i in range(REQUESTS)}
        assert client.xpending(stream, keys.WORKER_GROUP)["pending"] == 0
        assert client.xlen(stream) == 0  # answered entries are acknowledged and deleted
