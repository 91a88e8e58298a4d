"""Early runs in a worker on a real Redis: lone requests of a quiet model are answered by runs
made while their delay ran out, and requests that join one are still batched with it."""

from __future__ import annotations

import contextlib
from pathlib import Path

import redis
import torch
from sluice.shared import keys
from sluice.shared.protocol import encode_requests
from sluice.shared.stats import read_stats_command, stats_hash

from tests.streams import collect_results, int_request, running_worker

#: long enough for the test's next requests to join a lone one while it waits.
DELAY_US = 100_000
QUIET = 70

CONFIG = f"""
name: "plus"
platform: "pytorch_libtorch"
max_batch_size: 4
input [ {{ name: "IN", data_type: TYPE_INT64, dims: [ 1 ] }} ]
output [ {{ name: "OUT", data_type: TYPE_INT64, dims: [ 1 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: {DELAY_US} }}
"""


class PlusOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_lone_requests_are_answered_by_early_runs_and_joiners_still_batch(
    tmp_path: Path, redis_url: str
) -> None:
    repo = tmp_path / "repo"
    (repo / "plus" / "1").mkdir(parents=True)
    (repo / "plus" / "config.pbtxt").write_text(CONFIG)
    torch.jit.save(torch.jit.script(PlusOne()), str(repo / "plus" / "1" / "model.pt"))
    client = redis.Redis.from_url(redis_url)
    stream, reply_to = keys.request_stream("plus"), keys.reply_stream("test")
    with running_worker(repo, redis_url), contextlib.closing(client):
        seen: list[tuple[str, int]] = []
        for i in range(QUIET):  # one at a time: none joins another's wait
            client.xadd(stream, encode_requests([int_request(i, reply_to)]))
            seen = collect_results(client, reply_to, i + 1)
        assert seen == [(f"r{i}", i + 1) for i in range(QUIET)]
        answered = _statistic(client, "early_answered")
        assert answered > 0  # the last lone requests were answered by early runs
        # four at once, the last three sent while the first may run early
        for i in range(QUIET, QUIET + 4):
            client.xadd(stream, encode_requests([int_request(i, reply_to)]))
        late = collect_results(client, reply_to, QUIET + 4)[QUIET:]
        assert sorted(late) == [(f"r{i}", i + 1) for i in range(QUIET, QUIET + 4)]
        assert _statistic(client, "execution_count") >= QUIET + 1
        assert _statistic(client, "inference_count") == QUIET + 4  # a dropped run counts none


def _statistic(client: redis.Redis, name: str) -> int:
    stats = stats_hash(client.execute_command(*read_stats_command("plus")))
    return int(stats.get(f"1:{name}".encode(), 0))
