"""Bounded shutdown: SIGTERM under load, and a drain that cannot finish, end within
--drain-timeout-s; requests sent before the signal get an answer or a clear error.

What is guaranteed: a request whose bytes reached the gateway before its stop signal is
answered, with its result or with a JSON error (a 503 once the drain timeout is up); the
signalled process and everything it started are gone within the drain timeout and a second
or two. A request sent after the signal may find the port closed (connection refused).
"""

from __future__ import annotations

import os
import random
import signal
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis
from sluice.shared import keys
from sluice.shared.drain_deadline import CUT_SHORT_STATUS
from sluice.shared.protocol import encode_requests

from tests.closed_loop_load import ClosedLoopLoad, Outcome
from tests.conftest import HERE, Service, start_service, start_sluice, stop_service, wait_until
from tests.process_tree import alive, descendants
from tests.streams import int_model_config, int_request, write_python_model

DRAIN_S = 4.0
#: the bound the issue sets: every process of the tree gone within drain timeout + 5 s.
GONE_WITHIN_S = DRAIN_S + 5
CONCURRENCY = 64
#: the issue's 20 signals, spread over workers, gateways and whole serves at random moments.
#: Each costs a process start (a python model, no torch model to load): about 40 s for all 20
#: on a 2-core machine. SLUICE_SHUTDOWN_SIGNALS changes the count, SLUICE_SHUTDOWN_SEED
#: replays a run (the seed is in every failure message).
SIGNALS = int(os.environ.get("SLUICE_SHUTDOWN_SIGNALS", "20"))
SEED = int(os.environ.get("SLUICE_SHUTDOWN_SEED", str(time.time_ns() % 100_000)))

INFER_PATH = "/v2/models/affine/infer"
INFER_BODY = orjson.dumps(
    {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
)
STUCK_MODEL = textwrap.dedent("""
    import os
    import time


    class Model:
        def __init__(self, context):
            pass

        def infer(self, inputs):
            open(os.environ["STUCK_MARKER"], "w").close()
            time.sleep(3600)
""")


@pytest.fixture(scope="module")
def affine_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("shutdown") / "models"
    (repo / "affine" / "1").mkdir(parents=True)
    for part in ("config.pbtxt", "1/model.py"):
        (repo / "affine" / part).write_text((HERE / "model_repo" / "affine" / part).read_text())
    return repo


def _stop_and_time(service: Service) -> float:
    """SIGTERM `service`; seconds until it and every process it started are gone."""
    tree = {service.process.pid, *descendants(service.process.pid)}
    started = time.monotonic()
    service.process.send_signal(signal.SIGTERM)
    wait_until(lambda: not any(alive(pid) for pid in tree), "the process tree to end", 60)
    return time.monotonic() - started


def _finish(service: Service) -> None:
    """After the process ended: reaped, its log read to the end, its pipe closed."""
    service.process.wait(10)
    service.pump.join(10)
    assert service.process.stdout is not None
    service.process.stdout.close()


def _check(outcomes: list[Outcome], signal_at: float, what: str) -> None:
    """Every request sent before the signal got its result or a JSON error."""
    before = [o for o in outcomes if o.sent_at < signal_at]
    unanswered = [o.error for o in before if o.status is None]
    assert not unanswered, f"{what}: {len(unanswered)} unanswered, e.g. {unanswered[:3]}"
    for outcome in before:
        reply = orjson.loads(outcome.body)
        if outcome.status == 200:
            assert reply["outputs"][0]["data"] == [3, 5, 7, 9], what
        else:
            assert outcome.status == 503 and reply["error"], (what, outcome)


def _signal_under_load(rng: random.Random, service: Service, gateway: Service, what: str) -> None:
    """Load `gateway` at c=64, SIGTERM `service` at a random moment, check the bounds."""
    load = ClosedLoopLoad(gateway.http_url, INFER_PATH, INFER_BODY, CONCURRENCY).start()
    moment = rng.randint(1, 400)  # answers before the signal: 0 to a few seconds of load
    wait_until(lambda: load.answered >= moment, "load to flow")
    signal_at = time.monotonic()
    took = _stop_and_time(service)
    if service is not gateway:  # the fleet still serves: its gateway answers what is left
        answered = load.answered
        wait_until(lambda: load.answered > answered + CONCURRENCY, "the rest of the fleet")
    outcomes = load.stop()
    _finish(service)
    assert took < GONE_WITHIN_S, f"{what} took {took:.1f} s to exit (seed {SEED})"
    _check(outcomes, signal_at, f"{what} (seed {SEED})")


def _worker(repo: Path, redis_url: str, *extra: str, env: dict[str, str] | None = None) -> Service:
    args = ["--model-repository", str(repo), "--redis-url", redis_url, *extra]
    return start_sluice("worker", [*args, "--drain-timeout-s", str(DRAIN_S)], env, "ready on")


def _gateway(redis_url: str) -> Service:
    return start_sluice("gateway", ["--redis-url", redis_url, "--drain-timeout-s", str(DRAIN_S)])


@pytest.fixture
def fleet(affine_repo: Path, redis_url: str) -> Iterator[dict[str, Service]]:
    """Two workers and a gateway on one Redis; the test replaces the ones it stops."""
    members = {"worker": _worker(affine_repo, redis_url), "spare": _worker(affine_repo, redis_url)}
    members["gateway"] = _gateway(redis_url)
    yield members
    for member in members.values():
        if member.process.poll() is None:
            stop_service(member)


def test_sigterm_at_random_moments_of_a_c64_load_ends_in_time_and_answers_all(
    affine_repo: Path, redis_url: str, fleet: dict[str, Service], tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    kinds = [("worker", "gateway", "serve")[i % 3] for i in range(SIGNALS)]
    rng.shuffle(kinds)
    for kind in kinds:
        if kind == "serve":
            args = ["--model-repository", str(affine_repo), "--bulk-workers", "0"]
            env = {"XDG_RUNTIME_DIR": str(tmp_path)}
            serve = start_service([*args, "--drain-timeout-s", str(DRAIN_S)], env)
            _signal_under_load(rng, serve, serve, "serve")
            continue
        _signal_under_load(rng, fleet[kind], fleet["gateway"], kind)
        fleet[kind] = _worker(affine_repo, redis_url) if kind == "worker" else _gateway(redis_url)


def test_worker_stuck_in_a_batch_exits_at_the_deadline_and_leaves_it_pending(
    tmp_path: Path, redis_url: str
) -> None:
    repo = write_python_model(tmp_path / "repo", "stuck", int_model_config("stuck"), STUCK_MODEL)
    marker = tmp_path / "running"
    worker = _worker(repo, redis_url, env={"STUCK_MARKER": str(marker)})
    client = redis.Redis.from_url(redis_url)
    stream = keys.request_stream("stuck")
    client.xadd(stream, encode_requests([int_request(1, "replies")]))
    wait_until(marker.exists, "the batch to start")
    took = _stop_and_time(worker)
    assert worker.process.wait(5) == CUT_SHORT_STATUS
    _finish(worker)
    assert took < GONE_WITHIN_S
    log = "".join(worker.log)
    assert "exits after the drain timeout (4 s); still pending: stuck: 1 batches running" in log
    assert client.xpending(stream, keys.WORKER_GROUP)["pending"] == 1  # another worker's now
    client.close()


def test_serve_with_a_stuck_model_answers_503_and_ends_its_tree_in_time(tmp_path: Path) -> None:
    repo = write_python_model(tmp_path / "repo", "stuck", int_model_config("stuck"), STUCK_MODEL)
    marker = tmp_path / "running"
    env = {"STUCK_MARKER": str(marker), "XDG_RUNTIME_DIR": str(tmp_path)}
    args = ["--model-repository", str(repo), "--bulk-workers", "0"]
    serve = start_service([*args, "--drain-timeout-s", str(DRAIN_S)], env)
    answers: list[tuple[int, bytes]] = []
    body = b'{"inputs": [{"name": "IN", "shape": [1, 1], "datatype": "INT64", "data": [1]}]}'
    url = f"http://{serve.http_url}/v2/models/stuck/infer"

    def infer() -> None:
        try:
            with urllib.request.urlopen(url, body, timeout=60) as response:
                answers.append((response.status, response.read()))
        except urllib.error.HTTPError as exc:
            answers.append((exc.code, exc.read()))

    client = threading.Thread(target=infer)
    client.start()
    wait_until(marker.exists, "the batch to start")
    took = _stop_and_time(serve)
    client.join(30)
    _finish(serve)
    assert took < GONE_WITHIN_S
    assert serve.process.wait(5) in (0, CUT_SHORT_STATUS)
    [(status, reply)] = answers
    assert status == 503
    assert "gateway shutting down" in orjson.loads(reply)["error"]


def test_a_second_signal_ends_a_stuck_worker_at_once(tmp_path: Path, redis_url: str) -> None:
    repo = write_python_model(tmp_path / "repo", "stuck", int_model_config("stuck"), STUCK_MODEL)
    marker = tmp_path / "running"
    args = ["--model-repository", str(repo), "--redis-url", redis_url, "--drain-timeout-s", "600"]
    worker = start_sluice("worker", args, {"STUCK_MARKER": str(marker)}, "ready on")
    client = redis.Redis.from_url(redis_url)
    client.xadd(keys.request_stream("stuck"), encode_requests([int_request(1, "replies")]))
    client.close()
    wait_until(marker.exists, "the batch to start")
    worker.process.send_signal(signal.SIGTERM)
    wait_until(lambda: any("stopping" in line for line in worker.log), "the drain to start")
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(30) == CUT_SHORT_STATUS
    _finish(worker)
    assert "exits after a second stop signal" in "".join(worker.log)


def test_serve_leaves_no_child_when_killed_outright(affine_repo: Path, tmp_path: Path) -> None:
    """The children die with serve even when it gets no chance to stop them (SIGKILL). A
    worker, told to stop as its parent dies, drains first: its own deadline (short here)
    bounds that even when the embedded Redis it would answer through is gone with serve."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    args = ["--model-repository", str(affine_repo), "--bulk-workers", "0"]
    serve = start_service([*args, "--drain-timeout-s", "5"], env)
    tree = descendants(serve.process.pid)
    serve.process.send_signal(signal.SIGKILL)
    serve.process.wait(10)
    wait_until(lambda: not any(alive(pid) for pid in tree), "serve's children to end", 30)
    _finish(serve)
