"""The embedded Redis: persistence across restart(), no server outliving its owner, and its
maxmemory."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import redis

from sluice.embedded_redis import (
    MAXMEMORY_SHARE,
    EmbeddedRedis,
    default_maxmemory,
    memory_available,
)

DEADLINE_S = 15.0


def _set_and_restart(server: EmbeddedRedis) -> bytes | None:
    client = redis.Redis.from_url(server.url)
    try:
        client.set("sluice:test:key", b"kept")
        client.xadd("sluice:test:stream", {"f": b"v"})
    finally:
        client.close()
    old_pid = server.process.pid if server.process else None
    server.restart()
    assert server.process is not None and server.process.pid != old_pid
    client = redis.Redis.from_url(server.url)
    try:
        return client.get("sluice:test:key")
    finally:
        client.close()


def test_persistent_server_keeps_data_across_restart() -> None:
    with EmbeddedRedis(persistent=True) as server:
        assert _set_and_restart(server) == b"kept"
        client = redis.Redis.from_url(server.url)
        try:
            assert client.xlen("sluice:test:stream") == 1
        finally:
            client.close()


def test_non_persistent_server_comes_back_empty() -> None:
    with EmbeddedRedis() as server:
        assert _set_and_restart(server) is None


def test_restart_after_kill() -> None:
    with EmbeddedRedis(persistent=True) as server:
        client = redis.Redis.from_url(server.url)
        try:
            client.set("k", b"v")  # appendfsync always: on disk before the reply
        finally:
            client.close()
        server.kill()
        assert not server.running
        server.restart()
        client = redis.Redis.from_url(server.url)
        try:
            assert client.get("k") == b"v"
        finally:
            client.close()


def test_stop_removes_the_directory() -> None:
    server = EmbeddedRedis(persistent=True).start()
    directory = server.directory
    assert os.path.isdir(directory)
    server.stop()
    assert not os.path.exists(directory)
    assert not server.running


def _gone(pid: int) -> bool:
    """True once `pid` has exited: no /proc entry, or a zombie nobody has reaped yet."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("State:"):
                    return line.split()[1] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True
    return False


CHILD = textwrap.dedent(
    """
    import sys, time
    from sluice.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis().start()
    print(server.process.pid, server.directory, flush=True)
    time.sleep(120)
    """
)


def test_server_dies_with_a_killed_parent() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, "the child did not start its server"
    pid_text, directory = line.split()
    redis_pid = int(pid_text)
    try:
        assert not _gone(redis_pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            # poll() is waitpid(WNOHANG): reaps the child once it is dead
            if child.poll() is not None and _gone(redis_pid):
                break
            time.sleep(0.01)
        assert child.poll() == -signal.SIGKILL, "the child survived SIGKILL"
        assert _gone(redis_pid), "redis-server outlived its killed parent"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        if not _gone(redis_pid):
            os.kill(redis_pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)


def test_maxmemory_is_set_with_noeviction() -> None:
    with EmbeddedRedis(maxmemory=64 << 20) as server:
        client = redis.Redis.from_url(server.url)
        try:
            config = client.config_get("maxmemory*")
        finally:
            client.close()
    assert config["maxmemory"] == str(64 << 20)
    assert config["maxmemory-policy"] == "noeviction"


def test_default_maxmemory_is_a_share_of_the_cgroup_limit_when_lower(tmp_path: Path) -> None:
    physical = memory_available(())
    limited, unlimited = tmp_path / "memory.max", tmp_path / "v1.limit"
    limited.write_text(f"{physical // 2}\n")
    unlimited.write_text("max\n")
    assert memory_available((str(unlimited),)) == physical
    assert memory_available((str(unlimited), str(limited))) == physical // 2
    assert memory_available((str(tmp_path / "absent"),)) == physical
    assert default_maxmemory() == memory_available() // MAXMEMORY_SHARE
