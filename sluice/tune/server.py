"""The server `sluice tune` measures on when given a repository: its own `sluice serve`
(embedded Redis, free ports, explicit model control so that candidates load live), stopped
when the run ends."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from sluice.embedded_redis import tied_to_parent

#: seconds `sluice serve` may take to load the model before tune gives up
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
POLL_S = 0.2


class ServeFailed(Exception):
    """Tune's own `sluice serve` exited or did not get the model ready."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def serve_argv(repository: Path, model: str, workers: int, http_port: int) -> list[str]:
    """One gateway, no gRPC and no bulk workers: only the model and the HTTP port tune uses."""
    return [
        *(sys.executable, "-P", "-m", "sluice", "serve"),
        *("--model-repository", str(repository), "--workers", str(workers)),
        *("--model-control-mode", "explicit", "--load-model", model),
        *("--http-port", str(http_port), "--metrics-port", str(free_port())),
        *("--grpc-port", "0", "--gateways", "1", "--bulk-workers", "0"),
    ]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def own_serve(repository: Path, model: str, workers: int, log_path: Path) -> Iterator[str]:
    """`sluice serve` on the repository, its output in `log_path`; yields its host:port once
    the model is ready."""
    port = free_port()
    with log_path.open("ab") as log:
        # tied: a tune killed outright (SIGTERM, SIGKILL) takes its serve with it
        argv = tied_to_parent(serve_argv(repository, model, workers, port))
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        ready_url = f"http://127.0.0.1:{port}/v2/models/{model}/ready"
        give_up = time.monotonic() + START_TIMEOUT_S
        while not _ready(ready_url):
            if process.poll() is not None:
                raise ServeFailed(f"sluice serve exited ({process.returncode}); see {log_path}")
            if time.monotonic() > give_up:
                raise ServeFailed(
                    f"model {model} not ready in {START_TIMEOUT_S:g} s; see {log_path}"
                )
            time.sleep(POLL_S)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
