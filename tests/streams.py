"""Helpers for tests that play the gateway's part straight on Redis streams."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import redis
from sluice.shared import keys
from sluice.shared.protocol import Request, Tensor, decode_results

GATED_CONFIG = """
name: "gated"
backend: "python"
max_batch_size: {max_batch}
input [ {{ name: "IN", data_type: TYPE_INT64, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_INT64, dims: [ 1 ] }} ]
dynamic_batching {{ }}
"""

GATED_MODEL = textwrap.dedent('''
    import os

    from sluice.shared.redis_client import sync_client


    class Model:
        """Holds every batch until the test lets it go, so the test sees what was pulled."""

        def __init__(self, context):
            self.redis = sync_client(os.environ["GATE_REDIS_URL"])

        def infer(self, inputs):
            self.redis.rpush("entered", len(inputs["IN"]))
            self.redis.blpop("gate")
            return {"OUT": inputs["IN"] + 1}
''')

#: a python-backend model that adds one to IN, for tests about the worker around it.
PLUS_ONE_MODEL = textwrap.dedent("""
    class Model:
        def __init__(self, context):
            pass

        def infer(self, inputs):
            return {"OUT": inputs["IN"] + 1}
""")


def int_model_config(name: str) -> str:
    """A python-backend model `name` taking INT64 `IN` and answering INT64 `OUT`, batches of
    up to 4."""
    return f"""
name: "{name}"
backend: "python"
max_batch_size: 4
input [ {{ name: "IN", data_type: TYPE_INT64, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_INT64, dims: [ 1 ] }} ]
"""


def write_python_model(root: Path, name: str, config: str, model: str) -> Path:
    """A repository at `root` holding version 1 of a python-backend model."""
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    (root / name / "1" / "model.py").write_text(model)
    return root


def write_gated_repo(root: Path, max_batch: int) -> Path:
    return write_python_model(root, "gated", GATED_CONFIG.format(max_batch=max_batch), GATED_MODEL)


def int_request(i: int, reply_to: str) -> Request:
    data = np.array([[i]], dtype=np.int64)
    return Request(
        f"r{i}", 1, time.time_ns(), reply_to, [Tensor("IN", "INT64", (1, 1), data.tobytes())]
    )


def start_worker(repo: Path, redis_url: str, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sluice",
            "worker",
            "--model-repository",
            str(repo),
            "--redis-url",
            redis_url,
            *extra,
        ],
        env={**os.environ, "GATE_REDIS_URL": redis_url},
    )


@contextlib.contextmanager
def running_worker(repo: Path, redis_url: str, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    """A worker for the block, which must then stop cleanly on SIGTERM."""
    worker = start_worker(repo, redis_url, *extra)
    try:
        yield worker
    finally:
        worker.terminate()
        assert worker.wait(30) == 0


@contextlib.contextmanager
def serving_python_model(
    root: Path, name: str, config: str, model: str, redis_url: str, *worker_options: str
) -> Iterator[redis.Redis]:
    """A worker serving a python-backend model for the block, and a client of its Redis."""
    repo = write_python_model(root, name, config, model)
    client = redis.Redis.from_url(redis_url)
    with running_worker(repo, redis_url, *worker_options), contextlib.closing(client):
        yield client


def collect_results(client: redis.Redis, reply_to: str, expected: int) -> list[tuple[str, int]]:
    """Every (request id, first output value) published to `reply_to`, in order."""
    seen: list[tuple[str, int]] = []
    last = "0-0"
    while len(seen) < expected:
        reply = client.xread({reply_to: last}, block=60_000)
        assert reply, "workers stopped answering"
        for entry_id, fields in reply[0][1]:
            last = entry_id
            for result in decode_results(fields):
                assert result.error is None, result.error
                seen.append((result.id, int(np.frombuffer(result.outputs[0].data, np.int64)[0])))
    return seen


def request_stream() -> str:
    return keys.request_stream("gated")
