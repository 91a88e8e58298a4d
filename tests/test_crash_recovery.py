"""Workers killed with SIGKILL lose nothing; a request that keeps killing them is dead-lettered."""

from __future__ import annotations

import collections
import signal
import textwrap
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from sluice.shared import keys
from sluice.shared.protocol import encode_requests
from sluice.shared.redis_client import sync_client
from tritonclient.utils import InferenceServerException

from tests.conftest import start_service, stop_service
from tests.streams import (
    collect_results,
    int_request,
    request_stream,
    start_worker,
    write_gated_repo,
    write_python_model,
)

RECOVERY = ("--claim-idle-ms", "600", "--max-deliveries", "2")


def test_batch_of_a_killed_worker_is_served_by_another(tmp_path: Path, redis_url: str) -> None:
    repo = write_gated_repo(tmp_path, 4)
    client = sync_client(redis_url)
    reply_to = keys.reply_stream("test")
    # two requests per entry, as a gateway coalesces them: the entry must be split on takeover
    for i in range(0, 8, 2):
        client.xadd(
            request_stream(),
            encode_requests([int_request(i, reply_to), int_request(i + 1, reply_to)]),
        )
    doomed = start_worker(repo, redis_url, *RECOVERY)
    _, held = client.blpop("entered", timeout=60)
    assert int(held) == 4
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(30)
    client.rpush("gate", *range(100))
    survivor = start_worker(repo, redis_url, *RECOVERY)
    try:
        results = collect_results(client, reply_to, 8)
        assert sorted(results) == sorted((f"r{i}", i + 1) for i in range(8))
        assert collections.Counter(rid for rid, _ in results).most_common(1)[0][1] == 1
        assert client.xpending(request_stream(), keys.WORKER_GROUP)["pending"] == 0
        assert client.xlen(request_stream()) == 0
    finally:
        survivor.terminate()
        assert survivor.wait(30) == 0
        client.close()


POISON_CONFIG = """
name: "fragile"
backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 300000 }
"""

POISON_MODEL = textwrap.dedent('''
    import os


    class Model:
        """Kills its whole worker process when it meets 666."""

        def __init__(self, context):
            pass

        def infer(self, inputs):
            if (inputs["IN"] == 666).any():
                os._exit(3)
            return {"OUT": inputs["IN"] + 1}
''')


@pytest.fixture
def fragile_repo(tmp_path: Path) -> Path:
    return write_python_model(tmp_path, "fragile", POISON_CONFIG, POISON_MODEL)


def _infer(client: httpclient.InferenceServerClient, value: int) -> httpclient.InferAsyncRequest:
    tensor = httpclient.InferInput("IN", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], np.int32))
    return client.async_infer("fragile", [tensor])


def test_poison_request_is_dead_lettered_and_the_rest_served(
    fragile_repo: Path, redis_url: str
) -> None:
    service = start_service(
        ["--model-repository", str(fragile_repo), "--redis-url", redis_url, *RECOVERY]
    )
    client = httpclient.InferenceServerClient(service.http_url, network_timeout=120)
    try:
        values = [1, 666, 2, 3]
        pending = [_infer(client, v) for v in values]
        for value, request in zip(values, pending, strict=True):
            if value == 666:
                with pytest.raises(InferenceServerException) as err:
                    request.get_result()
                assert err.value.status() == "500"
                assert "dead-letter" in err.value.message()
            else:
                assert request.get_result().as_numpy("OUT")[0, 0] == value + 1
        dead = sync_client(redis_url).xrange(keys.dead_letters("fragile"))
        assert len(dead) == 1
        assert int(dead[0][1][b"deliveries"]) == 3
        assert _infer(client, 41).get_result().as_numpy("OUT")[0, 0] == 42
        metrics = urllib.request.urlopen(f"http://{service.metrics_url}/metrics").read()
        assert b'sluice_dead_lettered_requests_total{model="fragile"} 1.0' in metrics
        assert b'sluice_reclaimed_entries_total{model="fragile"}' in metrics
    finally:
        client.close()
        stop_service(service)
