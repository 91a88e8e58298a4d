"""Fleet membership and status (GET /v2/fleet, `sluice status`) against real gateways and
workers, and a fleet that changes under load without losing a request."""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sluice.shared import keys
from sluice.shared.fleet import fleet_status
from sluice.shared.redis_client import async_client, sync_client
from sluice.shared.registry import Member, encode_model_record, now_ms

from tests.conftest import Service, start_sluice, stop_service, wait_until

DEADLINE_S = 15.0
CLAIM_IDLE = ["--claim-idle-ms", "1000"]
#: what each of the fleet's workers serves.
SUBSETS = ["affine", "affine", "batch8,affine"]
#: pause between one connection's requests: steady load that leaves CPU for new workers.
PACE_S = 0.02


@dataclass
class Fleet:
    gateways: list[Service]
    workers: list[Service]
    #: started during a test; stopped with the rest.
    extra: list[Service] = field(default_factory=list)


def _worker(model_repo: Path, url: str, models: str) -> Service:
    args = ["--model-repository", str(model_repo), "--redis-url", url, "--models", models]
    return start_sluice("worker", [*args, *CLAIM_IDLE], ready=f"'{models.split(',')[-1]}' versions")


def _gateway(url: str) -> Service:
    return start_sluice("gateway", ["--redis-url", url])


def _start_all(starters: list[Callable[[], Service]]) -> list[Service]:
    """Start processes side by side (imports dominate); stop them all if one fails."""
    with ThreadPoolExecutor(len(starters)) as pool:
        futures = [pool.submit(start) for start in starters]
    failures = [f.exception() for f in futures if f.exception() is not None]
    started = [f.result() for f in futures if f.exception() is None]
    if failures:
        for service in started:
            stop_service(service)
        raise failures[0]  # type: ignore[misc]
    return started


@pytest.fixture
def fleet(model_repo: Path, redis_url: str) -> Iterator[Fleet]:
    """Two gateways and three workers (SUBSETS)."""
    services = _start_all(
        [lambda: _gateway(redis_url)] * 2
        + [lambda m=m: _worker(model_repo, redis_url, m) for m in SUBSETS]
    )
    group = Fleet(services[:2], services[2:])
    try:
        yield group
    finally:
        for service in [*group.gateways, *group.workers, *group.extra]:
            stop_service(service)


def _get(service: Service, path: str) -> Any:
    host, port = service.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        assert response.status == 200
        return json.loads(response.read())
    finally:
        conn.close()


def _wait_for(read: Callable[[], dict], ok: Callable[[dict], bool]) -> dict:
    """Poll a status until `ok` holds (heartbeats land once a second)."""
    deadline = time.monotonic() + DEADLINE_S
    pause = threading.Event()
    while True:
        status = read()
        if ok(status):
            return status
        assert time.monotonic() < deadline, f"fleet never settled: {status}"
        pause.wait(0.1)


def _models_by_pid(status: dict, kind: str) -> dict[int, set[str]]:
    return {m["pid"]: set(m["models"]) for m in status["members"] if m["kind"] == kind}


def _status_cli(url: str, *flags: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "sluice", "status", "--redis-url", url, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_fleet_lists_every_member_and_drops_a_stopped_worker(fleet: Fleet, redis_url: str) -> None:
    expected = {
        w.process.pid: set(m.split(",")) for w, m in zip(fleet.workers, SUBSETS, strict=True)
    }
    gateways = {g.process.pid for g in fleet.gateways}

    def complete(status: dict) -> bool:
        return (
            _models_by_pid(status, "worker") == expected
            and set(_models_by_pid(status, "gateway")) == gateways
        )

    for gateway in fleet.gateways:
        status = _wait_for(lambda g=gateway: _get(g, "/v2/fleet"), complete)
    worker = next(m for m in status["members"] if m["kind"] == "worker")
    assert worker["devices"] == ["cpu"]
    assert worker["models"]["affine"]["instances"] == 1
    assert len(status["models"]["affine"]["workers"]) == 3
    assert len(status["models"]["batch8"]["workers"]) == 1
    assert status["models"]["affine"]["states"] == {"READY": 3}

    assert complete(json.loads(_status_cli(redis_url, "--json")))
    table = _status_cli(redis_url)
    assert socket.gethostname() in table
    for member in status["members"]:
        assert member["id"] in table
    assert "affine" in table and "batch8" in table
    assert "READY 3" in table

    gone = fleet.workers[0].process.pid
    assert stop_service(fleet.workers[0]) == 0
    status = _wait_for(
        lambda: _get(fleet.gateways[1], "/v2/fleet"),
        lambda s: gone not in _models_by_pid(s, "worker"),
    )
    assert len(_models_by_pid(status, "worker")) == 2
    assert len(status["models"]["affine"]["workers"]) == 2


def _infer_loop(
    gateway: Service,
    values: Iterator[int],
    stop: threading.Event,
    answered: list[int],
    failures: list[str],
) -> None:
    """Send affine requests on one keep-alive connection until told to stop; check each."""
    host, port = gateway.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        while not stop.is_set():
            n = next(values)
            x = [n + 0.5, -n - 0.25, 0.75, n * 2 + 0.5]  # never 13: affine fails on it
            body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": x}]}
            conn.request("POST", "/v2/models/affine/infer", json.dumps(body))
            response = conn.getresponse()
            reply = json.loads(response.read())
            if response.status != 200 or reply["outputs"][0]["data"] != [2 * v + 1 for v in x]:
                failures.append(f"{n}: {response.status} {reply}")
            answered.append(n)
            stop.wait(PACE_S)
    except Exception as exc:  # reported by the test, not lost in a thread
        failures.append(repr(exc))
    finally:
        conn.close()


def test_workers_join_leave_and_crash_under_load_lose_nothing(
    fleet: Fleet, model_repo: Path, redis_url: str
) -> None:
    values = itertools.count()
    stop = threading.Event()
    answered: list[int] = []
    failures: list[str] = []
    loaders = [
        threading.Thread(target=_infer_loop, args=(g, values, stop, answered, failures))
        for g in fleet.gateways * 3
    ]
    for loader in loaders:
        loader.start()
    try:
        wait_until(lambda: len(answered) >= 100 or bool(failures), "the first answers")
        fleet.extra.append(_worker(model_repo, redis_url, "affine"))
        crashed = fleet.workers[2]
        crashed.process.kill()  # its requests are taken over after --claim-idle-ms
        crashed.process.wait(30)
        assert stop_service(fleet.workers[0]) == 0  # SIGTERM: finishes what it holds
        after = len(answered)
        wait_until(
            lambda: (len(answered) >= max(600, after + 200)) or bool(failures),
            "answers after the changes",
        )
    finally:
        stop.set()
        for loader in loaders:
            loader.join(90)
    assert not failures, failures[:5]
    assert not any(loader.is_alive() for loader in loaders)
    assert len(answered) == len(set(answered)) >= 600

    live = {fleet.workers[1].process.pid, fleet.extra[0].process.pid}
    _wait_for(
        lambda: _get(fleet.gateways[0], "/v2/fleet"),
        lambda s: set(_models_by_pid(s, "worker")) == live,
    )


async def _status(url: str) -> dict:
    client = async_client(url)
    try:
        return await fleet_status(client)
    finally:
        await client.aclose()


def test_worker_with_a_model_subset_serves_only_those(model_repo: Path, redis_url: str) -> None:
    worker = start_sluice(
        "worker",
        ["--model-repository", str(model_repo), "--redis-url", redis_url, "--models", "batch8"],
        ready="'batch8' versions",
    )
    try:
        status = _wait_for(
            lambda: asyncio.run(_status(redis_url)),
            lambda s: worker.process.pid in _models_by_pid(s, "worker"),
        )
        assert _models_by_pid(status, "worker") == {worker.process.pid: {"batch8"}}
        assert set(status["models"]) == {"batch8"}
        assert len(status["models"]["batch8"]["workers"]) == 1
    finally:
        stop_service(worker)


async def test_status_reads_queues_that_do_not_exist_yet(redis_url: str) -> None:
    """Priority streams nobody created, entries nobody reads, dead letters, a stale member."""
    config = {"name": "ghost", "dynamic_batching": {"priority_levels": 2}}
    probe = sync_client(redis_url)
    try:
        probe.hset(keys.MODELS, "ghost", encode_model_record(config, [1], None))
        probe.xadd(keys.request_stream("ghost", 2), {"d": b"x"})
        probe.xadd(keys.dead_letters("ghost"), {"d": b"x"})
        stale = Member("worker-old", "worker", "h", 1, now_ms() - 60_000)
        probe.hset(keys.FLEET, stale.id, stale.encode())
    finally:
        probe.close()
    status = await _status(redis_url)
    assert status["members"] == []
    ghost = status["models"]["ghost"]
    assert ghost["queue_depth"] == 1
    assert ghost["lag"] == 1  # no consumer group: nothing was delivered
    assert ghost["pending"] == 0
    assert ghost["dead_letters"] == 1
    assert 0 <= ghost["oldest_waiting_ms"] < 60_000
    assert ghost["workers"] == []
