"""Job long-polls share the gateway's one subscription to job events: however many wait, they
hold no Redis connection each, and every one of them is woken by the job's announcement."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgpack
import numpy as np
import pytest
from sluice.shared import keys
from sluice.shared.protocol import Result, Tensor, encode_results, job_event
from sluice.shared.redis_client import is_cluster, sync_client

from tests.conftest import Service, wait_until
from tests.test_jobs import _call

WAITERS = 20


def _held(redis: Any) -> int:
    """Connections waiting in Redis: blocked on a command, or subscribed (idle pooled ones,
    which any request borrows, are not held)."""
    return sum(
        1
        for client in redis.client_list()
        if "b" in client["flags"] or int(client["sub"]) or int(client["psub"])
    )


def _xrange_calls(redis: Any) -> int:
    stats = redis.info("commandstats").get("cmdstat_xrange", {})
    return int(stats.get("calls", 0))


def test_concurrent_long_polls_use_one_redis_connection(service: Service) -> None:
    redis = sync_client(service.redis_url)
    if is_cluster(redis):
        pytest.skip("counts the connections of one Redis server")
    job_id = f"waits-{uuid.uuid4().hex}"
    stream = keys.job_stream(job_id)
    # a job queued that no worker answers: its stream holds its metadata entry only
    meta = {"model": "nobatch", "version": 1, "client_id": None, "outputs": None, "binary": False}
    redis.xadd(stream, {"m": msgpack.packb(meta)})
    redis.expire(stream, 300)
    held = _held(redis)
    reads = _xrange_calls(redis)
    with ThreadPoolExecutor(WAITERS) as pool:
        polls = [
            pool.submit(_call, service, "GET", f"/v2/jobs/{job_id}?wait=60") for _ in range(WAITERS)
        ]
        wait_until(lambda: _xrange_calls(redis) >= reads + WAITERS, "every long-poll read the job")
        during = _held(redis)
        # the job is answered as a worker answers it: the result entry, then its announcement
        out = np.arange(6, dtype=np.float32)
        result = Result(job_id, [Tensor("OUT", "FP32", (3, 2), out.tobytes())])
        redis.xadd(stream, encode_results([result]))
        redis.publish(keys.job_channel(job_id), job_event(job_id, "done"))
        answers = [poll.result() for poll in polls]
    assert during == held  # the long-polls hold none of their own
    for status, body, _ in answers:
        assert status == 200
        assert body["outputs"][0]["data"] == out.tolist()
