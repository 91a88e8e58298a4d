"""A worker skips the batching delay while its model's requests arrive further apart than it."""

from __future__ import annotations

from pathlib import Path

from shared import keys
from shared.protocol import encode_requests
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


def test_a_request_after_a_quiet_spell_runs_without_waiting_the_delay(
    tmp_path: Path, redis_url: str
) -> None:
    stream = keys.request_stream("plus")
    reply_to = keys.reply_stream("test")
    with serving_python_model(tmp_path, "plus", CONFIG, PLUS_ONE_MODEL, redis_url) as client:
        earlier = int_request(0, reply_to)
        earlier.enqueue_ns -= 2 * DELAY_US * 1000  # already past its delay: it runs at once
        client.xadd(stream, encode_requests([earlier]))
        assert collect_results(client, reply_to, 1) == [("r0", 1)]
        # twenty minutes since the last arrival: waiting ten would not bring another request
        client.xadd(stream, encode_requests([int_request(1, reply_to)]))
        assert collect_results(client, reply_to, 2) == [("r0", 1), ("r1", 2)]
