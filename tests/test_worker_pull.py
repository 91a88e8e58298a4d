"""A worker pulls only what a free instance can take, and answers everything it pulled."""

from __future__ import annotations

from pathlib import Path

import redis

from shared import keys
from shared.protocol import encode_requests
from tests.streams import (
    collect_results,
    int_request,
    request_stream,
    start_worker,
    write_gated_repo,
)

MAX_BATCH = 4
REQUESTS = 40


def test_worker_pulls_only_for_free_instances(tmp_path: Path, redis_url: str) -> None:
    repo = write_gated_repo(tmp_path, MAX_BATCH)
    client = redis.Redis.from_url(redis_url)
    reply_to = keys.reply_stream("test")
    stream = request_stream()
    for i in range(REQUESTS):
        client.xadd(stream, encode_requests([int_request(i, reply_to)]))
    worker = start_worker(repo, redis_url)
    try:
        _, first = client.blpop("entered", timeout=60)
        assert int(first) == MAX_BATCH
        delivered = client.xpending(stream, keys.WORKER_GROUP)["pending"]
        assert MAX_BATCH <= delivered <= 2 * MAX_BATCH
        assert client.xlen(stream) == REQUESTS  # nothing acknowledged while the batch is held
        client.rpush("gate", *range(REQUESTS))
        results = dict(collect_results(client, reply_to, REQUESTS))
        assert results == {f"r{i}": i + 1 for i in range(REQUESTS)}
        assert client.xpending(stream, keys.WORKER_GROUP)["pending"] == 0
        assert client.xlen(stream) == 0  # answered entries are acknowledged and deleted
    finally:
        worker.terminate()
        assert worker.wait(30) == 0
        client.close()
