"""A worker pulls only what a free instance can take, and answers everything it pulled."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from shared import keys
from shared.protocol import Request, Tensor, decode_results, encode_requests

MAX_BATCH = 4
REQUESTS = 40

CONFIG = f"""
name: "gated"
backend: "python"
max_batch_size: {MAX_BATCH}
input [ {{ name: "IN", data_type: TYPE_INT64, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_INT64, dims: [ 1 ] }} ]
dynamic_batching {{ }}
"""

MODEL = textwrap.dedent('''
    import os

    import redis


    class Model:
        """Holds every batch until the test lets it go, so the test sees what was pulled."""

        def __init__(self, context):
            self.redis = redis.Redis.from_url(os.environ["GATE_REDIS_URL"])

        def infer(self, inputs):
            self.redis.rpush("entered", len(inputs["IN"]))
            self.redis.blpop("gate")
            return {"OUT": inputs["IN"] + 1}
''')


@pytest.fixture
def gated_repo(tmp_path: Path) -> Path:
    (tmp_path / "gated" / "1").mkdir(parents=True)
    (tmp_path / "gated" / "config.pbtxt").write_text(CONFIG)
    (tmp_path / "gated" / "1" / "model.py").write_text(MODEL)
    return tmp_path


def _request(i: int, reply_to: str) -> Request:
    data = np.array([[i]], dtype=np.int64)
    return Request(
        f"r{i}", 1, time.time_ns(), reply_to, [Tensor("IN", "INT64", (1, 1), data.tobytes())]
    )


def test_worker_pulls_only_for_free_instances(gated_repo: Path, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    reply_to = keys.reply_stream("test")
    stream = keys.request_stream("gated")
    for i in range(REQUESTS):
        client.xadd(stream, encode_requests([_request(i, reply_to)]))
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sluice",
            "worker",
            "--model-repository",
            str(gated_repo),
            "--redis-url",
            redis_url,
        ],
        env={**os.environ, "GATE_REDIS_URL": redis_url},
    )
    try:
        _, first = client.blpop("entered", timeout=60)
        assert int(first) == MAX_BATCH
        delivered = client.xpending(stream, keys.WORKER_GROUP)["pending"]
        assert MAX_BATCH <= delivered <= 2 * MAX_BATCH
        assert client.xlen(stream) == REQUESTS  # nothing acknowledged while the batch is held
        client.rpush("gate", *range(REQUESTS))
        results = {}
        last = "0-0"
        while len(results) < REQUESTS:
            reply = client.xread({reply_to: last}, block=30_000)
            assert reply, "worker stopped answering"
            for entry_id, fields in reply[0][1]:
                last = entry_id
                for result in decode_results(fields):
                    results[result.id] = np.frombuffer(result.outputs[0].data, np.int64)[0]
        assert results == {f"r{i}": i + 1 for i in range(REQUESTS)}
        assert client.xpending(stream, keys.WORKER_GROUP)["pending"] == 0
        assert client.xlen(stream) == 0  # answered entries are acknowledged and deleted
    finally:
        worker.terminate()
        assert worker.wait(30) == 0
        client.close()
