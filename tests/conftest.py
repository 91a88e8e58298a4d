"""Real parts for the tests: a private redis-server, and `sluice serve` on a test repository."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gevent
import pytest
from sluice.shared.redis_client import sync_client

from sluice.embedded_redis import EmbeddedRedis
from tests.redis_cluster import EmbeddedCluster

HERE = Path(__file__).parent
READY_LINE = "sluice ready"

#: every `sluice serve` a test starts runs one gateway, whatever this host's cores would choose
#: (tests that want more say --gateways)
os.environ.setdefault("SLUICE_GATEWAYS", "1")
START_TIMEOUT_S = 120


#: SLUICE_TEST_CLUSTER=1 runs the tests against a 3-master Redis Cluster (tests/run.sh does,
#: for the end-to-end modules) instead of a single server.
ON_CLUSTER = os.environ.get("SLUICE_TEST_CLUSTER") == "1"
needs_single_redis = pytest.mark.skipif(
    ON_CLUSTER, reason="needs a single Redis server, not a cluster"
)


def _redis() -> EmbeddedRedis | EmbeddedCluster:
    return EmbeddedCluster() if ON_CLUSTER else EmbeddedRedis()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis | EmbeddedCluster]:
    with _redis() as server:
        yield server


@pytest.fixture(scope="session")
def scratch_redis() -> Iterator[EmbeddedRedis | EmbeddedCluster]:
    """A second server for tests that flush it, apart from the shared service's."""
    with _redis() as server:
        yield server


@pytest.fixture
def redis_url(scratch_redis: EmbeddedRedis | EmbeddedCluster) -> Iterator[str]:
    """A flushed database of its own for one test."""
    client = sync_client(scratch_redis.url)
    client.flushall()
    client.close()
    yield scratch_redis.url


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll state held elsewhere (Redis, another process) until `condition` holds: for
    progress that has no event to await."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        pause.wait(0.01)


def wait_in_hub(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    """`wait_until` for a thread with tritonclient.http requests in flight: their async_infer
    sends from a greenlet, which runs only while this thread waits in gevent's hub."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        gevent.sleep(0.01)


def http_json(url: str, body: bytes | None = None) -> tuple[int, Any]:
    """GET `url` (POST `body`): the status and the JSON answered, an error's too."""
    request = urllib.request.Request(url, data=body)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: held open together while chosen, as ports chosen one after
    another can be the same one twice."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def build_named_args_model(path: Path) -> None:
    import torch

    class Scale(torch.nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return x * scale

    torch.jit.save(torch.jit.script(Scale()), str(path))


@pytest.fixture(scope="session")
def model_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repo") / "models"
    shutil.copytree(HERE / "model_repo", repo)
    (repo / "named_args" / "1").mkdir(parents=True, exist_ok=True)  # git keeps no empty dirs
    build_named_args_model(repo / "named_args" / "1" / "model.pt")
    return repo


@dataclass
class Service:
    process: subprocess.Popen[str]
    http_url: str
    metrics_url: str
    redis_url: str
    log: list[str]
    pump: threading.Thread
    #: host:port of the gRPC API (tritonclient.grpc's url)
    grpc_url: str = ""


def start_sluice(
    command: str, args: list[str], env: dict[str, str] | None = None, ready: str = READY_LINE
) -> Service:
    """Start `sluice <command> ...` and return once it logs `ready`."""
    http_port, metrics_port, grpc_port = free_ports(3)
    given = {"--http-port": http_port, "--metrics-port": metrics_port, "--grpc-port": grpc_port}
    ports = (
        [word for flag, port in given.items() for word in (flag, str(port))]
        if command in ("serve", "gateway")
        else []
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "sluice", command, *ports, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    log: list[str] = []
    started = threading.Event()
    settled = threading.Event()  # ready, or its output ended (it exited first)

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            log.append(line)
            if ready in line:
                started.set()
                settled.set()
        settled.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    if not (settled.wait(START_TIMEOUT_S) and started.is_set()):
        process.kill()
        process.wait()
        reader.join(10)
        assert process.stdout is not None
        process.stdout.close()
        raise RuntimeError(f"sluice {command} did not become ready:\n" + "".join(log))
    redis_url = args[args.index("--redis-url") + 1] if "--redis-url" in args else ""
    return Service(
        process,
        f"127.0.0.1:{http_port}",
        f"127.0.0.1:{metrics_port}",
        redis_url,
        log,
        reader,
        f"127.0.0.1:{grpc_port}",
    )


def start_service(args: list[str], env: dict[str, str] | None = None) -> Service:
    """Start `sluice serve ...` and return once it logs that it is ready."""
    return start_sluice("serve", args, env)


@contextlib.contextmanager
def serving_alone(repo: Path) -> Iterator[Service]:
    """`sluice serve` on `repo` with a Redis of its own, for a module's own models: the models
    a fleet announced stay in its Redis after it stops, and a later fleet on that Redis (the
    session's `service`) would wait for them to be served before it says it is ready."""
    with _redis() as server:
        service = start_service(["--model-repository", str(repo), "--redis-url", server.url])
        try:
            yield service
        finally:
            if service.process.poll() is None:
                stop_service(service)


def stop_service(service: Service) -> int:
    service.process.terminate()
    try:
        return service.process.wait(60)
    except subprocess.TimeoutExpired:
        service.process.kill()
        raise
    finally:
        service.pump.join(10)
        if service.process.stdout is not None:
            service.process.stdout.close()


@pytest.fixture(scope="session")
def service(model_repo: Path, redis_server: EmbeddedRedis) -> Iterator[Service]:
    """`sluice serve` with one worker on the test repository, for the whole session."""
    svc = start_service(["--model-repository", str(model_repo), "--redis-url", redis_server.url])
    yield svc
    stop_service(svc)
