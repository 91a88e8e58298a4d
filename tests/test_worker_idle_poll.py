"""A worker that ran lone requests on its event loop keeps polling for the next one
(`--idle-poll-us`), and sleeps at once with a zero window."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import redis
from sluice.shared import keys
from sluice.shared.protocol import encode_requests

from tests.conftest import wait_until
from tests.streams import (
    PLUS_ONE_MODEL,
    collect_results,
    int_model_config,
    int_request,
    running_worker,
    write_python_model,
)

CONFIG = int_model_config("plus")

#: ten minutes: a window that outlasts the test.
LONG_WINDOW_US = 600_000_000


def _state(pid: int) -> str:
    """The scheduler state of the worker's main thread, where its event loop runs."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _sleeps(pid: int) -> int:
    """How many times the worker's main thread has gone to sleep (a yield is not counted)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("voluntary_ctxt_switches"))
    return int(line.split()[1])


def _polling(pid: int) -> bool:
    """Runnable at every one of many looks, and never asleep in between: an idle worker wakes
    for its timers (~1/s) and sleeps again, which a short look may miss."""
    before = _sleeps(pid)
    return all(_state(pid) == "R" for _ in range(1000)) and _sleeps(pid) == before


@pytest.mark.parametrize("window_us", [LONG_WINDOW_US, 0])
def test_a_worker_polls_after_lone_requests_only_with_a_window(
    tmp_path: Path, redis_url: str, window_us: int
) -> None:
    repo = write_python_model(tmp_path, "plus", CONFIG, PLUS_ONE_MODEL)
    client = redis.Redis.from_url(redis_url)
    stream, reply_to = keys.request_stream("plus"), keys.reply_stream("test")
    with (
        running_worker(repo, redis_url, "--idle-poll-us", str(window_us)) as worker,
        contextlib.closing(client),
    ):
        # one at a time, each answered before the next: after the first two (which tell the
        # worker how long a run takes and how far apart requests come) they run on its loop
        for i in range(4):
            client.xadd(stream, encode_requests([int_request(i, reply_to)]))
            assert collect_results(client, reply_to, i + 1)[-1] == (f"r{i}", i + 1)
        if window_us:
            # once the last answer's publish returns (the test may see the answer first), the
            # loop keeps turning: never asleep across many looks in a row
            wait_until(lambda: _polling(worker.pid), "the worker to keep polling")
        else:
            wait_until(lambda: _state(worker.pid) == "S", "the worker to sleep")
