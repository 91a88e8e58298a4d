"""`sluice worker --health-port`: the probes an orchestrator uses on a worker."""

from __future__ import annotations

import http.client
import time
from pathlib import Path

from tests.conftest import free_port, free_ports, start_sluice, stop_service


def _get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    status = conn.getresponse().status
    conn.close()
    return status


def test_a_worker_is_live_and_ready_once_its_models_serve(redis_url: str, model_repo: Path) -> None:
    port = free_port()
    args = ["--model-repository", str(model_repo), "--redis-url", redis_url, "--models", "affine"]
    worker = start_sluice("worker", [*args, "--health-port", str(port)], ready="'affine' versions")
    try:
        assert _get(port, "/v2/health/live") == 200
        deadline = time.monotonic() + 30
        while _get(port, "/v2/health/ready") != 200:  # the first heartbeat has to land
            assert time.monotonic() < deadline, "worker never became ready"
            time.sleep(0.05)
        assert _get(port, "/v2/health/other") == 404
    finally:
        stop_service(worker)


def test_a_worker_that_cannot_reach_redis_is_live_but_not_ready(model_repo: Path) -> None:
    port, nowhere = free_ports(2)
    args = ["--model-repository", str(model_repo), "--models", "affine"]
    worker = start_sluice(
        "worker",
        [*args, "--redis-url", f"redis://127.0.0.1:{nowhere}", "--health-port", str(port)],
        ready="'affine' versions",
    )
    try:
        assert _get(port, "/v2/health/live") == 200
        assert _get(port, "/v2/health/ready") == 503
    finally:
        stop_service(worker)
