"""A Redis master, one replica and three sentinels on loopback, for failover tests.

The sentinels see the master down after `DOWN_AFTER_MS` and promote the replica; clients
given `url` (redis+sentinel://) ask them where the master is on every new connection.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

import redis

from sluice.embedded_redis import EmbeddedRedis, redis_server_binary, tied_to_parent
from tests.conftest import free_port, wait_until

MASTER_NAME = "sluice"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 10_000
SENTINELS = 3
QUORUM = 2
STARTUP_TIMEOUT_S = 20.0


class EmbeddedSentinelSet:
    """`with EmbeddedSentinelSet() as s: s.url`; `s.kill_master()` starts a failover."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="sluice-sentinel-")
        self.master = EmbeddedRedis(port=free_port())
        self.replica = EmbeddedRedis(
            port=free_port(), extra_args=("--replicaof", "127.0.0.1", str(self.master.port))
        )
        self.sentinel_ports = [free_port() for _ in range(SENTINELS)]
        self._sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER_NAME}"

    def _sentinel_config(self, port: int) -> str:
        path = Path(self._dir) / f"sentinel-{port}.conf"
        path.write_text(
            "\n".join(
                [
                    f"port {port}",
                    "bind 127.0.0.1",
                    f"dir {self._dir}",
                    f"logfile {self._dir}/sentinel-{port}.log",
                    f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master.port} {QUORUM}",
                    f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}",
                    f"sentinel parallel-syncs {MASTER_NAME} 1",
                    "",
                ]
            )
        )
        return str(path)

    def start(self) -> EmbeddedSentinelSet:
        self.master.start()
        self.replica.start()
        for port in self.sentinel_ports:
            args = [redis_server_binary(), self._sentinel_config(port), "--sentinel"]
            self._sentinels.append(subprocess.Popen(tied_to_parent(args)))
        wait_until(
            lambda: self._replicas_seen() >= 1 and self._sentinels_seen() >= SENTINELS,
            "the sentinels to see the replica and each other",
            STARTUP_TIMEOUT_S,
        )
        return self

    def _ask(self, port: int, *command: str) -> object:
        client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
        try:
            return client.execute_command(*command)
        finally:
            client.close()

    def _replicas_seen(self) -> int:
        try:
            info = self._ask(self.sentinel_ports[0], "SENTINEL", "REPLICAS", MASTER_NAME)
        except redis.RedisError:
            return 0
        return len(info) if isinstance(info, list) else 0

    def _sentinels_seen(self) -> int:
        """The sentinels the first one knows, itself included."""
        try:
            others = self._ask(self.sentinel_ports[0], "SENTINEL", "SENTINELS", MASTER_NAME)
        except redis.RedisError:
            return 0
        return 1 + (len(others) if isinstance(others, list) else 0)

    def master_port(self) -> int | None:
        """The master's port as the sentinels report it now."""
        try:
            reply = self._ask(
                self.sentinel_ports[0], "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME
            )
        except redis.RedisError:
            return None
        return int(reply[1]) if isinstance(reply, list) else None

    def kill_master(self) -> None:
        """SIGKILL the master, as a crash would; the sentinels promote the replica."""
        self.master.kill()

    def wait_promoted(self) -> None:
        wait_until(
            lambda: self.master_port() == self.replica.port,
            "the sentinels to promote the replica",
            STARTUP_TIMEOUT_S,
        )

    def stop(self) -> None:
        for process in self._sentinels:
            process.terminate()
        for process in self._sentinels:
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
        self.replica.stop()
        self.master.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedSentinelSet:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
