"""`sluice jobs worker`: quiet about routine maintenance, and bounded when stopped mid-job."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import redis
from sluice.shared.bulk import bulk_queue, bulk_status, submit_bulk
from sluice.shared.drain_deadline import CUT_SHORT_STATUS
from sluice.workers.bulk import BulkWorker

from tests.conftest import start_sluice, wait_until
from tests.process_tree import alive
from tests.streams import int_model_config, write_python_model

DRAIN_S = 3.0
#: a model that never answers: a bulk job on it feeds, then waits for answers for ever.
STUCK_MODEL = textwrap.dedent("""
    import time


    class Model:
        def __init__(self, context):
            pass

        def infer(self, inputs):
            time.sleep(3600)
""")


def _burst(redis_url: str, *args: str) -> list[str]:
    """The log of an rq worker that runs its start-up maintenance and exits (empty queue)."""
    command = [sys.executable, "-m", "sluice", "jobs", "worker", "--redis-url", redis_url]
    done = subprocess.run(
        [*command, "--burst", *args], capture_output=True, text=True, timeout=60, check=True
    )
    return (done.stdout + done.stderr).splitlines()


def test_registry_cleaning_is_logged_at_debug_not_info(redis_url: str) -> None:
    info = _burst(redis_url)
    assert any("Listening on" in line for line in info)  # rq's other INFO lines stay
    assert not [line for line in info if "cleaning" in line]
    debug = _burst(redis_url, "--log-level", "debug")
    cleaning = [line for line in debug if "cleaning registries" in line]
    assert cleaning and all(" DEBUG rq.worker" in line for line in cleaning)


def test_a_worker_stopped_mid_job_exits_at_its_deadline(tmp_path: Path, redis_url: str) -> None:
    repo = write_python_model(tmp_path / "repo", "stuck", int_model_config("stuck"), STUCK_MODEL)
    model_worker = start_sluice(
        "worker", ["--model-repository", str(repo), "--redis-url", redis_url], ready="ready on"
    )
    args = ["--redis-url", redis_url, "--drain-timeout-s", str(DRAIN_S)]
    rq_worker = start_sluice("jobs", ["worker", *args], ready="Listening on")
    client = redis.Redis.from_url(redis_url)
    try:
        items = io.BytesIO()
        np.save(items, np.arange(8, dtype=np.int64).reshape(8, 1))
        submit_bulk(client, "stuck", items.getvalue(), "npy", bulk_id="stuck-job")
        wait_until(lambda: bulk_status(client, "stuck-job").status == "running", "the job to run")
        started = time.monotonic()
        rq_worker.process.send_signal(signal.SIGTERM)
        assert rq_worker.process.wait(DRAIN_S + 5) == CUT_SHORT_STATUS
        assert time.monotonic() - started < DRAIN_S + 5
        rq_worker.pump.join(10)
        assert "still pending: bulk job stuck-job" in "".join(rq_worker.log)
    finally:
        client.close()
        for service in (rq_worker, model_worker):
            if alive(service.process.pid):
                service.process.kill()
            service.process.wait(10)
            service.pump.join(10)
            assert service.process.stdout is not None
            service.process.stdout.close()


def test_unsubscribing_ends_even_when_the_listener_reads_the_reply_first(redis_url: str) -> None:
    """rq's teardown sends UNSUBSCRIBE, then stops its pub/sub thread, which redis-py 8.2 joins
    with no timeout. When the thread reads the UNSUBSCRIBE reply before it is told to stop, it
    goes back to waiting for a subscription, as long as its poll: rq's 60 s, past any drain."""
    connection = redis.Redis.from_url(redis_url)
    worker = BulkWorker(
        [bulk_queue(connection)],
        connection=connection,
        serializer=bulk_queue(connection).serializer,
    )
    worker.subscribe()
    pubsub = worker.pubsub
    assert pubsub is not None
    wait_until(lambda: pubsub.subscribed, "the listener to subscribe")
    sent = pubsub.unsubscribe

    def reply_read_by_the_listener(*channels: str) -> None:
        sent(*channels)
        wait_until(lambda: not pubsub.subscribed, "the listener to read the reply")

    pubsub.unsubscribe = reply_read_by_the_listener  # type: ignore[method-assign]
    teardown = threading.Thread(target=worker.unsubscribe, daemon=True)
    teardown.start()
    teardown.join(BulkWorker.PUBSUB_POLL_S + 10)  # a hang bound, not a timing
    try:
        assert not teardown.is_alive(), "rq's unsubscribe waits out the listener's poll"
    finally:
        connection.close()
