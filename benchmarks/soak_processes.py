"""The processes a soak drives: `sluice serve` with its workers, and their memory use."""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import redis

from sluice.embedded_redis import tied_to_parent

READY_LINE = "sluice ready"
#: how often a starting serve's readiness is checked.
READY_POLL_S = 0.2
#: how long reading Redis's memory figures may take.
MEMORY_READ_TIMEOUT_S = 5
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """`python -m sluice serve` as a subprocess, its output pumped into a list by a thread."""

    def __init__(self, args: argparse.Namespace, redis_url: str) -> None:
        self.http_port = args.http_port or free_port()
        self.metrics_port = args.metrics_port or free_port()
        argv = [
            sys.executable,
            "-m",
            "sluice",
            "serve",
            "--model-repository",
            str(args.model_repository),
            "--redis-url",
            redis_url,
            "--workers",
            str(args.workers),
            "--http-port",
            str(self.http_port),
            "--metrics-port",
            str(self.metrics_port),
        ]
        if args.server_request_timeout_s is not None:
            argv += ["--request-timeout-s", str(args.server_request_timeout_s)]
        self.log: list[str] = []
        self.ready = threading.Event()
        self.process = subprocess.Popen(
            tied_to_parent(argv),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # our Ctrl-C goes to us; we stop serve ourselves
        )
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.log.append(line.rstrip("\n"))
            if READY_LINE in line:
                self.ready.set()

    def wait_ready(self, timeout_s: float) -> None:
        deadline_s = time.monotonic() + timeout_s
        while not self.ready.wait(READY_POLL_S):
            if self.process.poll() is not None or time.monotonic() > deadline_s:
                tail = "\n".join(self.log[-40:])
                raise SystemExit(f"sluice serve did not become ready:\n{tail}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def worker_pids(self) -> list[int]:
        """The `sluice worker` children of the serve process, from /proc."""
        pids: list[int] = []
        for children in Path(f"/proc/{self.process.pid}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                pids.extend(int(p) for p in children.read_text().split())
        return sorted(p for p in set(pids) if _is_worker(p))

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            code = None
        self._pump.join(10)
        if self.process.stdout is not None:
            self.process.stdout.close()
        return code


def _is_worker(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"worker" in argv and any(b"sluice" in a for a in argv)


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def memory_snapshot(serve: Serve, redis_url: str) -> dict[str, Any]:
    used: int | None = None
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=MEMORY_READ_TIMEOUT_S)
        try:
            used = int(client.info("memory")["used_memory"])
        finally:
            client.close()
    except redis.RedisError:
        pass
    workers = {pid: rss_mib(pid) for pid in serve.worker_pids()}
    return {"redis_used": used, "gateway": rss_mib(serve.process.pid), "workers": workers}
