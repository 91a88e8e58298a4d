"""sluice and its peers as processes: each peer in a virtual environment of its own, started on
loopback with the reference MLP, and stopped with everything it started.

The peers' packages never enter sluice's own environment: `--setup` makes one venv per peer
under $PEERS_HOME (default /tmp/peers) with the peer and torch 2.13.0 pinned (sluice's torch,
so the model runs the same kernels everywhere).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.process_tree import alive, descendants

ROOT = Path(__file__).resolve().parent.parent
PEER_CODE = ROOT / "benchmarks" / "peers"
HOME = Path(os.environ.get("PEERS_HOME", "/tmp/peers"))
TORCH = "torch==2.13.0"
#: how long asking a peer's environment for its versions may take.
VERSION_TIMEOUT_S = 60
#: how long a killed server may take to exit, then its whole tree.
KILLED_TIMEOUT_S = 10
TREE_EXIT_TIMEOUT_S = 5
TREE_EXIT_POLL_S = 0.2
#: what each peer's venv gets, and the distribution whose version the report names
INSTALLS: dict[str, tuple[str, ...]] = {
    "pytriton": ("nvidia-pytriton==0.7.0", "nvidia-pytriton"),
    "ray": ("ray[serve]==2.60.0", "ray"),
    "bentoml": ("bentoml==1.4.40", "bentoml"),
    "litserve": ("litserve==0.2.19", "litserve", "numpy==2.4.6"),  # it needs no numpy itself
}
#: installed after, without their dependencies: Ray Serve's gRPC servicer is KServe's, from
#: tritonclient (serve_ray.py), whose stated protobuf bound (< 7) ray's protobuf 7 breaks but
#: whose generated code loads under it.
WITHOUT_DEPENDENCIES: dict[str, tuple[str, ...]] = {
    "ray": ("tritonclient==2.73.0", "python-rapidjson==1.23"),
}
#: sluice as served by default (Triton's fixed batching delay) and with the opt-in adaptive
#: delay, which skips the wait while requests arrive further apart than it: each a server
#: of the comparison, so that both are measured side by side.
SLUICE_VARIANTS = {"sluice": [], "sluice-adaptive": ["--batch-delay", "adaptive"]}
#: how each server batches, for the report
SETTINGS = {
    "sluice": "max_batch_size 64, max_queue_delay_microseconds 1000 (the example's config), "
    "Triton's fixed wait with early runs (the default: a lone batch runs while the wait runs "
    "out), 1 worker, embedded Redis",
    "sluice-adaptive": "as sluice, with the opt-in --batch-delay adaptive (the 1 ms delay is "
    "skipped while requests arrive further apart than it; Triton's fixed wait otherwise)",
    "pytriton": "Triton dynamic batcher: max_batch_size 64, max_queue_delay_microseconds 1000; "
    "@batch infer function",
    "ray": "@serve.batch(max_batch_size=64, batch_wait_timeout_s=0.001), 1 replica, "
    "max_ongoing_requests raised from its default 5 to 64 (5 caps batches at 5); "
    "node IP 127.0.0.1, no dashboard; its replica's inter-deployment gRPC server binds [::] "
    "whatever the settings (unused here: the proxy calls the replica through Ray)",
    "bentoml": "@bentoml.api(batchable=True, max_batch_size=64), 1 worker; adaptive "
    "dispatcher, no window to set (max_latency_ms left at its default)",
    "litserve": "LitAPI(max_batch_size=64, batch_timeout=0.001), 1 CPU worker, "
    "other settings default",
}


def venv_python(peer: str) -> Path:
    return HOME / peer / "bin" / "python"


def setup(peers: list[str]) -> dict[str, str]:
    """Make each peer's venv and install it; 'ok' or why it failed, per peer."""
    (HOME / "logs").mkdir(parents=True, exist_ok=True)
    outcome = {}
    for peer in peers:
        log = HOME / "logs" / f"{peer}-install.log"
        steps = [
            ["python3", "-m", "venv", str(HOME / peer)],
            [
                str(venv_python(peer)),
                "-m",
                "pip",
                "install",
                INSTALLS[peer][0],
                *INSTALLS[peer][2:],
                TORCH,
            ],
        ]
        if peer in WITHOUT_DEPENDENCIES:
            pip = [str(venv_python(peer)), "-m", "pip", "install", "--no-deps"]
            steps.append([*pip, *WITHOUT_DEPENDENCIES[peer]])
        with log.open("w") as out:
            codes = [
                subprocess.run(s, stdout=out, stderr=subprocess.STDOUT).returncode for s in steps
            ]
        outcome[peer] = "ok" if not any(codes) else f"install failed, see {log}"
        print(f"{peer}: {outcome[peer]}", flush=True)
    return outcome


def is_sluice(peer: str) -> bool:
    return peer in SLUICE_VARIANTS


def version(peer: str) -> str:
    """The peer's and torch's versions as its venv has them."""
    if is_sluice(peer):
        python, dist = sys.executable, "sluice-serve"
    else:
        python, dist = str(venv_python(peer)), INSTALLS[peer][1]
    code = (
        "import importlib.metadata as m, sys\n"
        f"print(m.version({dist!r}), m.version('torch'), sys.version.split()[0])"
    )
    done = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S
    )
    if done.returncode != 0:
        return "?"
    ours, torch, py = done.stdout.split()
    return f"{dist} {ours}, torch {torch}, Python {py}"


def command(peer: str, port: int, model: Path, counter: Path, repo: Path) -> list[str]:
    """How the peer is started, serving on 127.0.0.1:port."""
    if is_sluice(peer):
        return [
            *(sys.executable, "-m", "sluice", "serve", "--model-repository", str(repo)),
            *("--http-port", str(port), "--grpc-port", str(port + 1)),
            *("--metrics-port", str(port + 2), "--log-level", "warning"),
            *SLUICE_VARIANTS[peer],
        ]
    if peer == "bentoml":
        bentoml = str(HOME / peer / "bin" / "bentoml")
        return [bentoml, "serve", "serve_bentoml:MLP", "--host", "127.0.0.1", "--port", str(port)]
    return [
        str(venv_python(peer)),
        str(PEER_CODE / f"serve_{peer}.py"),
        str(model),
        str(counter),
        str(port),
    ]


def environment(peer: str, model: Path, counter: Path) -> dict[str, str]:
    run = HOME / "run"
    return {
        **os.environ,
        "PYTHONPATH": str(PEER_CODE),
        "PEER_MODEL": str(model),
        "PEER_COUNTER": str(counter),
        # PyTriton's Python stub links libpython: the interpreter's own, not the system's copy
        "LD_LIBRARY_PATH": str(sysconfig.get_config_var("LIBDIR")),
        "PYTRITON_HOME": str(run / "pytriton"),
        "BENTOML_HOME": str(run / "bentoml"),
        "BENTOML_DO_NOT_TRACK": "True",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "XDG_RUNTIME_DIR": str(run),  # sluice serve's runtime file, away from others'
    }


Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _listening_inodes() -> dict[str, tuple[Address, int]]:
    """Socket inode -> address of every listening TCP socket on the machine."""
    found = {}
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # the kernel prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, width // 2, 4))
            ip = ipaddress.ip_address(words)
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            found[fields[9]] = ip, int(port, 16)
    return found


def listening(root: int) -> set[tuple[Address, int]]:
    """The TCP addresses that `root` and the processes below it listen on."""
    inodes = _listening_inodes()
    found = set()
    for pid in {root, *descendants(root)}:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                found.add(inodes[target[8:-1]])
    return found


@dataclass(slots=True)
class Server:
    peer: str
    port: int
    process: subprocess.Popen[bytes]
    counter: Path
    log: Path
    seen: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail(self, lines: int = 8) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def batches(self) -> tuple[int, int]:
        """(executions, inferences) the peer's model ran so far (its counter file)."""
        raw = self.counter.read_bytes() if self.counter.exists() else b""
        if len(raw) < 16:
            return 0, 0
        return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:16], "little")


def start(peer: str, port: int, model: Path, repo: Path) -> Server:
    run = HOME / "run"
    run.mkdir(parents=True, exist_ok=True)
    counter, log = run / f"{peer}.counter", run / f"{peer}.log"
    counter.unlink(missing_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(
            command(peer, port, model, counter, repo),
            cwd=PEER_CODE,
            env=environment(peer, model, counter),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Server(peer, port, process, counter, log)


def stop(server: Server, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL whatever of its tree is still there (only pids it started)."""
    server.seen |= descendants(server.pid)
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(KILLED_TIMEOUT_S)
    deadline_s = time.monotonic() + TREE_EXIT_TIMEOUT_S
    while any(alive(pid) for pid in server.seen) and time.monotonic() < deadline_s:
        time.sleep(TREE_EXIT_POLL_S)
    for pid in server.seen:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
