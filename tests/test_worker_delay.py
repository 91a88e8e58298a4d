"""The adaptive batching delay, opt-in: a worker skips the delay while its model's requests
arrive further apart than it, when the model's BATCH_DELAY or the server's --batch-delay asks."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from sluice.shared import keys
from sluice.shared.protocol import encode_requests

from tests.streams import PLUS_ONE_MODEL, collect_results, int_request, serving_python_model

#: ten minutes: a request that waited it out would outlast the test.
DELAY_US = 600_000_000

CONFIG = f"""
name: "plus"
backend: "python"
max_batch_size: 4
input [ {{ name: "IN", data_type: TYPE_INT64, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_INT64, dims: [ 1 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: {DELAY_US} }}
"""


def _parameter(mode: str) -> str:
    return f'parameters {{ key: "BATCH_DELAY" value {{ string_value: "{mode}" }} }}'


def _run_after_a_quiet_spell(client: redis.Redis) -> None:
    """One request long past its delay, then one twenty minutes after it: both answered."""
    stream = keys.request_stream("plus")
    reply_to = keys.reply_stream("test")
    earlier = int_request(0, reply_to)
    earlier.enqueue_ns -= 2 * DELAY_US * 1000  # already past its delay: it runs at once
    client.xadd(stream, encode_requests([earlier]))
    assert collect_results(client, reply_to, 1) == [("r0", 1)]
    # twenty minutes since the last arrival: waiting ten would not bring another request
    client.xadd(stream, encode_requests([int_request(1, reply_to)]))
    assert collect_results(client, reply_to, 2) == [("r0", 1), ("r1", 2)]


@pytest.mark.parametrize(
    ("config", "worker_options"),
    [
        (CONFIG + _parameter("adaptive"), ()),
        (CONFIG, ("--batch-delay", "adaptive")),
    ],
    ids=["model-parameter", "server-option"],
)
def test_adaptive_delay_runs_a_request_after_a_quiet_spell_at_once(
    tmp_path: Path, redis_url: str, config: str, worker_options: tuple[str, ...]
) -> None:
    with serving_python_model(
        tmp_path, "plus", config, PLUS_ONE_MODEL, redis_url, *worker_options
    ) as client:
        _run_after_a_quiet_spell(client)


def test_a_model_s_fixed_delay_wins_over_the_server_s_adaptive_default(
    tmp_path: Path, redis_url: str
) -> None:
    stream = keys.request_stream("plus")
    reply_to = keys.reply_stream("test")
    config = CONFIG + _parameter("fixed")
    with serving_python_model(
        tmp_path, "plus", config, PLUS_ONE_MODEL, redis_url, "--batch-delay", "adaptive"
    ) as client:
        earlier = int_request(0, reply_to)
        earlier.enqueue_ns -= 2 * DELAY_US * 1000
        client.xadd(stream, encode_requests([earlier]))
        assert collect_results(client, reply_to, 1) == [("r0", 1)]
        # under the fixed wait the lone request waits ten minutes: it is still unanswered when
        # a full batch of four behind it (itself included) makes the batch due
        client.xadd(stream, encode_requests([int_request(1, reply_to)]))
        for i in (2, 3, 4):
            client.xadd(stream, encode_requests([int_request(i, reply_to)]))
        results = collect_results(client, reply_to, 5)
        assert sorted(results) == [("r0", 1), ("r1", 2), ("r2", 3), ("r3", 4), ("r4", 5)]
        # one reply entry per batch: r0 alone, then r1 with the three that filled its batch
        assert client.xlen(reply_to) == 2
