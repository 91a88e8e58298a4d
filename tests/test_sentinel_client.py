"""redis+sentinel:// URLs: the sentinels, the master's name and its connection options; and
the clients made from them, against a real master, replica and three sentinels."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sluice.shared.redis_client import parse_sentinel_url

from tests.conftest import needs_single_redis
from tests.redis_sentinel import EmbeddedSentinelSet


def test_a_sentinel_url_names_the_sentinels_the_master_and_its_options() -> None:
    target = parse_sentinel_url(
        "redis+sentinel://app:p%40ss@10.0.0.1:26380,sentinel-b,[::1]:5/jobs?db=3"
    )
    assert target is not None
    assert target.sentinels == [("10.0.0.1", 26380), ("sentinel-b", 26379), ("::1", 5)]
    assert target.master == "jobs"
    assert target.options == {"username": "app", "password": "p@ss", "db": 3}


def test_other_schemes_are_not_sentinel_urls() -> None:
    assert parse_sentinel_url("redis://127.0.0.1:6379/0") is None
    assert parse_sentinel_url("unix:///tmp/redis.sock") is None


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("redis+sentinel://127.0.0.1:26379", "names no master"),
        ("redis+sentinel://127.0.0.1:x/m", "bad sentinel address"),
        ("redis+sentinel://127.0.0.1:26379/m?db=one", "db must be a number"),
    ],
)
def test_a_malformed_sentinel_url_says_what_is_wrong(url: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        parse_sentinel_url(url)


#: run in a process of its own: a signal delivered to a process that has run native libraries
#: of other tests (OpenVINO's CPU plugin) can crash it, whatever this test does.
INTERRUPTED_READ = """
import signal, sys
from sluice.shared.redis_client import sync_client

class Interrupted(Exception):
    pass

def interrupt(signum, frame):
    raise Interrupted

client = sync_client(sys.argv[1])
signal.signal(signal.SIGALRM, interrupt)
try:
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    client.blpop(["queue"], timeout=5)
    sys.exit("the pop was not interrupted")
except Interrupted:
    pass
finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
assert client.lpush("queue", "job") == 1, "the pop's late reply came back"
assert client.lrange("queue", 0, -1) == [b"job"]
client.close()
"""


@needs_single_redis
def test_a_sync_read_interrupted_by_a_signal_leaves_no_reply_behind() -> None:
    """rq stops a worker by raising from a signal handler during its blocking pop; the
    connection must not go back to the pool with that pop's reply still to come."""
    with EmbeddedSentinelSet() as sentinels:
        run = subprocess.run(
            [sys.executable, "-c", INTERRUPTED_READ, sentinels.url],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert run.returncode == 0, run.stderr
