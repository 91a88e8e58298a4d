"""`sluice serve` with its embedded Redis: one command up, one signal down, nothing left."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient

from sluice.settings import JOBS_WORKER_SETTINGS_ENV, WORKER_SETTINGS_ENV
from tests.conftest import HERE, free_ports, start_service, stop_service, wait_until
from tests.process_tree import alive, descendants


def _infer_ones(url: str) -> np.ndarray:
    """batch8's answer to a [1, 4] input of ones."""
    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput("IN", [1, 4], "FP32")
    inp.set_data_from_numpy(np.ones((1, 4), np.float32))
    try:
        return client.infer("batch8", [inp]).as_numpy("OUT")
    finally:
        client.close()


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_serve_starts_redis_and_workers_and_leaves_nothing(
    model_repo: Path, stop_signal: signal.Signals
) -> None:
    service = start_service(["--model-repository", str(model_repo), "--workers", "2"])
    children = descendants(service.process.pid)
    commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children}
    assert sum(b"redis-server" in c for c in commands.values()) == 1
    assert sum(b"sluice\0worker\0" in c for c in commands.values()) == 2
    assert sum(b"\0jobs\0worker\0" in c for c in commands.values()) == 1  # bulk jobs (rq)
    np.testing.assert_array_equal(_infer_ones(service.http_url), np.ones((1, 4)) * 2)
    service.process.send_signal(stop_signal)
    assert service.process.wait(60) == 0
    stop_service(service)
    assert not [pid for pid in children if alive(pid)]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_serve_log_level_applies_to_every_process_it_starts(model_repo: Path) -> None:
    http_port, metrics_port, grpc_port = free_ports(3)
    command = [sys.executable, "-m", "sluice", "serve", "--model-repository", str(model_repo)]
    command += ["--http-port", str(http_port), "--metrics-port", str(metrics_port)]
    command += ["--grpc-port", str(grpc_port)]
    process = subprocess.Popen(
        [*command, "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"127.0.0.1:{http_port}"
        wait_until(lambda: _ready(url), "the service to be ready")
        assert _infer_ones(url) is not None
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    assert not [line for line in output.splitlines() if " INFO " in line]


def _handed_down(pid: int, variable: str) -> dict[str, object] | None:
    prefix = f"{variable}=".encode()
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(prefix):
            return dict(orjson.loads(item.removeprefix(prefix)))
    return None


def test_serve_hands_its_children_settings_not_options(model_repo: Path) -> None:
    service = start_service(
        [
            *("--model-repository", str(model_repo), "--batch-delay", "adaptive"),
            *("--idle-poll-us", "0", "--claim-idle-ms", "5000", "--drain-timeout-s", "7"),
        ]
    )
    try:
        commands = {
            pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:-1]
            for pid in descendants(service.process.pid)
        }
        (worker,) = [pid for pid, argv in commands.items() if argv[3:4] == [b"worker"]]
        (jobs,) = [pid for pid, argv in commands.items() if argv[3:4] == [b"jobs"]]
        # a plain worker, no options
        assert commands[worker] == [b"-P", b"-m", b"sluice", b"worker"]
        settings = _handed_down(worker, WORKER_SETTINGS_ENV)
        assert settings is not None
        assert settings["batch_delay"] == "adaptive" and settings["idle_poll_us"] == 0
        assert settings["claim_idle_ms"] == 5000 and settings["drain_timeout_s"] == 7.0
        assert settings["model_repository"] == str(model_repo)
        assert str(settings["redis_url"]).startswith(("redis://", "unix://"))  # the embedded one
        assert commands[jobs] == [b"-P", b"-m", b"sluice", b"jobs", b"worker"]
        jobs_settings = _handed_down(jobs, JOBS_WORKER_SETTINGS_ENV)
        assert jobs_settings == {
            "redis_url": settings["redis_url"],
            "burst": False,
            "log_level": "info",
            "log_file": None,
            "log_format": "default",
            "drain_timeout_s": 7.0,
            # a password is folded into the URL: the children are handed it there alone
            "redis_password": None,
            "redis_password_file": None,
        }
        # the worker runs on what it was handed: it serves the repository it was not told on
        # its command line
        np.testing.assert_array_equal(_infer_ones(service.http_url), np.ones((1, 4)) * 2)
    finally:
        stop_service(service)


#: well under the drain timeout (30 s), which an idle serve must never wait out.
IDLE_STOP_BOUND_S = 10.0


@pytest.mark.parametrize("idle_s", [0, 7, 13, 25, 40])
def test_an_idle_serve_stops_in_seconds(tmp_path: Path, idle_s: int) -> None:
    """Left idle for a while, a serve's processes (gateway, worker, rq worker, Redis) stop at
    once: none of them waits for a poll or a blocking read to run out."""
    repo = tmp_path / "models"
    shutil.copytree(HERE / "model_repo" / "batch8", repo / "batch8")
    service = start_service(["--model-repository", str(repo)])
    time.sleep(idle_s)  # the idle spell is the scenario, not a wait for some state
    started = time.monotonic()
    service.process.send_signal(signal.SIGTERM)
    try:
        code = service.process.wait(60)
    finally:
        stopped_s = time.monotonic() - started
        stop_service(service)
    assert code == 0
    assert stopped_s < IDLE_STOP_BOUND_S, "".join(service.log[-30:])
    assert "drain timeout" not in "".join(service.log)
