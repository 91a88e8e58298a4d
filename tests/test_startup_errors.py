"""Start-up mistakes: one line on stderr naming the option, exit status 2, nothing running."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.preflight import check_repository
from tests.conftest import free_port

MARK = "SLUICE_STARTUP_TEST_MARK"
KNOWN_SCHEMES = "(use redis://, rediss://, unix://, redis+sentinel://)"


def _marked_processes(mark: str) -> list[int]:
    """Processes whose environment carries `mark`: the command and anything it started."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"{MARK}={mark}".encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found


def _start(*args: str) -> tuple[int, list[str]]:
    """Run `sluice ...`; its exit status and stderr lines, once nothing it started runs."""
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark, "XDG_RUNTIME_DIR": "/nonexistent"}
    env.pop("SLUICE_REDIS_URL", None)
    done = subprocess.run(
        [sys.executable, "-m", "sluice", *args], capture_output=True, text=True, env=env, timeout=60
    )
    assert _marked_processes(mark) == []
    return done.returncode, done.stderr.splitlines()


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield int(listener.getsockname()[1])


def _serve(repo: Path, *args: str) -> tuple[int, list[str]]:
    ports = ("--http-port", str(free_port()), "--metrics-port", str(free_port()))
    ports += ("--grpc-port", str(free_port()))
    return _start("serve", "--model-repository", str(repo), *ports, *args)


def test_a_busy_http_port(model_repo: Path, busy_port: int) -> None:
    assert _serve(model_repo, "--http-port", str(busy_port)) == (
        2,
        [f"sluice: --http-port {busy_port}: address already in use"],
    )


def test_a_busy_metrics_port(model_repo: Path, busy_port: int) -> None:
    assert _serve(model_repo, "--metrics-port", str(busy_port)) == (
        2,
        [f"sluice: --metrics-port {busy_port}: address already in use"],
    )


def test_a_busy_grpc_port(model_repo: Path, busy_port: int) -> None:
    assert _serve(model_repo, "--grpc-port", str(busy_port)) == (
        2,
        [f"sluice: --grpc-port {busy_port}: address already in use"],
    )


def test_the_same_port_twice(model_repo: Path) -> None:
    port = str(free_port())
    assert _serve(model_repo, "--http-port", port, "--metrics-port", port) == (
        2,
        [f"sluice: --metrics-port {port}: already taken by --http-port"],
    )


def test_a_missing_repository(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    assert _serve(missing) == (2, [f"sluice: --model-repository {missing}: no such directory"])


def test_a_file_as_repository(tmp_path: Path) -> None:
    file = tmp_path / "config.pbtxt"
    file.write_text("")
    assert _serve(file) == (2, [f"sluice: --model-repository {file}: not a directory"])


def test_an_empty_repository_holds_no_model(tmp_path: Path) -> None:
    # a folder without config.pbtxt or a version folder is no model either
    (tmp_path / "not-a-model" / "v1").mkdir(parents=True)
    code, lines = _serve(tmp_path)
    assert code == 2
    assert lines == [
        f"sluice: --model-repository {tmp_path}: model repository {tmp_path} holds no model "
        "(expected <model>/<version>/ and, unless its files say, <model>/config.pbtxt)"
    ]


def test_a_model_without_config_pbtxt_is_a_model(tmp_path: Path) -> None:
    """Triton auto-completes it from its files: the start-up check lets it through."""
    (tmp_path / "m" / "1").mkdir(parents=True)
    check_repository(tmp_path)


def test_an_unreachable_redis(model_repo: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    code, [line] = _serve(model_repo, "--redis-url", url)
    assert code == 2
    assert line.startswith(f"sluice: --redis-url {url}: cannot reach Redis (")
    assert "Connection refused" in line


def test_a_bad_url_scheme_hides_the_password(model_repo: Path) -> None:
    code, [line] = _serve(model_repo, "--redis-url", "http://user:secret@127.0.0.1:6379")
    assert code == 2
    assert line == (
        f"sluice: --redis-url http://user:***@127.0.0.1:6379: unknown scheme 'http' {KNOWN_SCHEMES}"
    )


def test_gateway_and_worker_check_too(model_repo: Path, busy_port: int, redis_url: str) -> None:
    gateway = ("gateway", "--redis-url", redis_url, "--metrics-port", str(busy_port))
    gateway += ("--grpc-port", str(free_port()))
    assert _start(*gateway) == (2, [f"sluice: --metrics-port {busy_port}: address already in use"])
    worker = ("worker", "--redis-url", redis_url, "--model-repository", str(model_repo))
    assert _start(*worker, "--health-port", str(busy_port)) == (
        2,
        [f"sluice: --health-port {busy_port}: address already in use"],
    )
    # a Redis that is not up yet is waited for (a fleet starts in any order); a wrong URL is not
    assert _start(
        "worker", "--redis-url", "127.0.0.1:6379", "--model-repository", str(model_repo)
    ) == (
        2,
        [f"sluice: --redis-url 127.0.0.1:6379: unknown scheme '' {KNOWN_SCHEMES}"],
    )
