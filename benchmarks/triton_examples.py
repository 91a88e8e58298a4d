"""NVIDIA's own Triton example programs, run unchanged against sluice and against tritonserver.

A Triton user's client code must work on sluice as it is. This runs the example programs of
triton-inference-server/client (`src/python/examples/`) and triton-inference-server/python_backend
(`examples/`), each byte for byte in its own process with a timeout, and prints a pass/fail
table per server. The model repository is built in a temporary folder from sluice's stand-ins
(`tests/triton_examples_repo/`: Python-backend models named, typed and shaped as the
TensorFlow/ONNX originals the client examples call) and the python_backend examples' own models,
copied as their READMEs say. Examples that need a GPU (CUDA shared memory), images or downloads are
listed as skipped.

The python_backend examples call `localhost:8000/8001/8002`, so each server is started on those
ports (they must be free). tritonserver is the anchor's (../shared/anchor). Usage:

    python benchmarks/triton_examples.py --client /tmp/client --python-backend /tmp/python_backend \
        --servers sluice,triton

`--servers none` runs against a server already listening on the default ports (default mode only).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAND_INS = ROOT / "tests" / "triton_examples_repo"
TRITON_START = ROOT.parent / "shared" / "anchor" / "start_tritonserver.sh"
PORTS = (8000, 8001, 8002)
#: how long a server may take to be ready, and each readiness query.
READY_TIMEOUT_S = 180
READY_QUERY_TIMEOUT_S = 2
#: how often a starting server's readiness, or a stopped one's ports, are checked.
POLL_S = 0.5
#: how long a stopped server may take to exit, then to free its ports.
STOP_TIMEOUT_S = 30
PORTS_FREE_TIMEOUT_S = 30


@dataclass(frozen=True)
class Example:
    """An example program: its path in a checkout, its server's mode, why it is skipped."""

    path: str
    explicit: tuple[str, ...] = ()  # explicit mode: python_backend models added to the stand-ins
    skip: str = ""
    #: its command-line arguments (the sequence examples' `-d`: the dynamic sequence models).
    args: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return " ".join((self.path, *self.args))


CLIENT = "src/python/examples/"
PB = "examples/"
CLIENT_EXAMPLES = (
    [
        Example(CLIENT + name)
        for name in (
            "simple_http_infer_client.py",
            "simple_grpc_infer_client.py",
            "simple_http_async_infer_client.py",
            "simple_grpc_async_infer_client.py",
            "simple_http_aio_infer_client.py",
            "simple_grpc_aio_infer_client.py",
            "simple_http_health_metadata.py",
            "simple_grpc_health_metadata.py",
            "simple_http_string_infer_client.py",
            "simple_grpc_string_infer_client.py",
            "simple_grpc_custom_args_client.py",
            "simple_grpc_keepalive_client.py",
            "simple_grpc_custom_repeat.py",
            "grpc_explicit_byte_content_client.py",
            "grpc_explicit_int_content_client.py",
            "grpc_explicit_int8_content_client.py",
            "memory_growth_test.py",
        )
    ]
    + [
        # system shared memory (each registers POSIX shared memory regions it creates)
        Example(CLIENT + name)
        for name in (
            "simple_http_shm_client.py",
            "simple_grpc_shm_client.py",
            "simple_http_shm_string_client.py",
            "simple_grpc_shm_string_client.py",
        )
    ]
    + [
        Example(CLIENT + "reuse_infer_objects_client.py", args=args)
        for args in (("-i", "http"), ("-i", "grpc", "-u", "localhost:8001"))
    ]
    + [
        # the sequence examples, on the sequence models and (-d) on the dynamic ones
        Example(CLIENT + name, args=args)
        for name in (
            "simple_http_sequence_sync_infer_client.py",
            "simple_grpc_sequence_sync_infer_client.py",
            "simple_grpc_sequence_stream_infer_client.py",
            "simple_grpc_aio_sequence_stream_infer_client.py",
        )
        for args in ((), ("-d",))
    ]
    + [
        # these count the models in their repository: seven for HTTP, eight for gRPC
        Example(CLIENT + "simple_http_model_control.py", explicit=("",)),
        Example(CLIENT + "simple_grpc_model_control.py", explicit=("", "repeat_int32")),
    ]
)
SKIPPED = [
    Example(CLIENT + name, skip=why)
    for why, names in (
        ("CUDA shared memory", ("simple_http_cudashm_client.py", "simple_grpc_cudashm_client.py")),
        (
            "image model + images",
            ("image_client.py", "grpc_image_client.py", "ensemble_image_client.py"),
        ),
        ("image model + images", ("grpc_client.py",)),
    )
    for name in names
] + [
    Example(PB + "jax/client.py", skip="jax"),
    Example(PB + "instance_kind/client.py", skip="ResNet50 download"),
    Example(PB + "preprocessing/client.py", skip="model download"),
]
PB_EXAMPLES = [
    Example(PB + name)
    for name in (
        "add_sub/client.py",
        "auto_complete/client.py",
        "bls/sync_client.py",
        "bls/async_client.py",
        "bls_decoupled/sync_client.py",
        "bls_decoupled/async_client.py",
        "custom_metrics/client.py",
        "decoupled/repeat_client.py",
        "decoupled/square_client.py",
        "pytorch/client.py",
    )
]
# python_backend example models: (name, model file, config file or "" where Triton completes it)
PB_MODELS = [
    ("add_sub", "add_sub/model.py", "add_sub/config.pbtxt"),
    ("nobatch_auto_complete", "auto_complete/nobatch_model.py", ""),
    ("batch_auto_complete", "auto_complete/batch_model.py", ""),
    ("bls_sync", "bls/sync_model.py", "bls/sync_config.pbtxt"),
    ("bls_async", "bls/async_model.py", "bls/async_config.pbtxt"),
    ("bls_decoupled_sync", "bls_decoupled/sync_model.py", "bls_decoupled/sync_config.pbtxt"),
    ("bls_decoupled_async", "bls_decoupled/async_model.py", "bls_decoupled/async_config.pbtxt"),
    ("custom_metrics", "custom_metrics/model.py", "custom_metrics/config.pbtxt"),
    ("repeat_int32", "decoupled/repeat_model.py", "decoupled/repeat_config.pbtxt"),
    ("square_int32", "decoupled/square_model.py", "decoupled/square_config.pbtxt"),
    ("pytorch", "pytorch/model.py", "pytorch/config.pbtxt"),
]


def build_repository(dest: Path, python_backend: Path | None, only: tuple[str, ...] = ()) -> Path:
    """The stand-ins plus, given a python_backend checkout, its example models (those in `only`
    if given) laid out as its READMEs say."""
    shutil.copytree(STAND_INS, dest, symlinks=False)
    if only:  # the model-control examples count seven stand-ins: this one only `-d` calls
        shutil.rmtree(dest / "simple_string_dyna_sequence")
    if python_backend is not None:
        for name, model, config in PB_MODELS:
            if only and name not in only:
                continue
            (dest / name / "1").mkdir(parents=True)
            shutil.copy(python_backend / PB / model, dest / name / "1" / "model.py")
            if config:
                shutil.copy(python_backend / PB / config, dest / name / "config.pbtxt")
    return dest


def ports_free() -> bool:
    """Whether 8000-8002 are all free on loopback (the python_backend examples hard-code them)."""
    for port in PORTS:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return False
    return True


def wait_ready(timeout_s: float, proc: subprocess.Popen[bytes] | None) -> bool:
    """Poll `/v2/health/ready` until it answers 200, the server exits, or `timeout_s` passes."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(
                "http://127.0.0.1:8000/v2/health/ready", timeout=READY_QUERY_TIMEOUT_S
            ) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(POLL_S)
    return False


def triton_venv(dest: Path) -> Path:
    """A venv for tritonserver's Python stub: the anchor's packages, then this environment's
    (torch). The stub ignores PYTHONPATH: the pytorch example finds torch through a `.pth`."""
    anchor = (
        Path(os.environ.get("ANCHOR_VENV", "/tmp/anchors/venv"))
        / "lib"
        / "python3.11"
        / "site-packages"
    )
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    site = dest / "lib" / "python3.11" / "site-packages"
    for name in ("pytriton", "nvidia_pytriton.libs"):
        (site / name).symlink_to(anchor / name)
    (site / "anchor.pth").write_text(f"{anchor}\n{sysconfig.get_paths()['purelib']}\n")
    return dest


def start_server(kind: str, repo: Path, explicit: bool, log: Path) -> subprocess.Popen[bytes]:
    """`sluice serve` or tritonserver on the default ports, in a session of its own."""
    mode = ["--model-control-mode", "explicit"] if explicit else []
    if kind == "sluice":
        cmd = [
            str(Path(sys.executable).with_name("sluice")),
            "serve",
            "--model-repository",
            str(repo),
            *mode,
        ]
        return subprocess.Popen(
            cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
        )
    # the anchor script backgrounds tritonserver and prints its pid: a shell holds it until TERM
    env = {**os.environ, "ANCHOR_VENV": str(log.parent / "triton-venv")}
    if not (log.parent / "triton-venv").exists():
        triton_venv(log.parent / "triton-venv")
    start = f"bash {TRITON_START} {repo} 8000 8001 8002 {log} {' '.join(mode)}"
    script = f'pid=$({start}); trap "kill -- -$pid" TERM; while kill -0 $pid; do sleep 0.5; done'
    return subprocess.Popen(["bash", "-c", script], env=env, start_new_session=True)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, then SIGKILL it if it lingers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
    deadline_s = time.monotonic() + PORTS_FREE_TIMEOUT_S
    while not ports_free() and time.monotonic() < deadline_s:
        time.sleep(POLL_S)


def run_example(program: Path, timeout_s: float, args: tuple[str, ...] = ()) -> tuple[str, str]:
    """Run one example unchanged in its folder: ('pass'|'FAIL'|'timeout', its last line)."""
    try:
        done = subprocess.run(
            [sys.executable, program.name, *args],
            cwd=program.parent,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return "timeout", ""
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return ("pass" if done.returncode == 0 else "FAIL"), (lines[-1][:110] if lines else "")


def run_suite(
    server: str,
    examples: list[tuple[Path, Example]],
    repos: dict[tuple[str, ...], Path],
    timeout_s: float,
    logs: Path,
) -> dict[str, tuple[str, str]]:
    """Every example on `server`: the default-mode ones on one server start, each explicit-mode
    one on a start of its own."""
    results: dict[str, tuple[str, str]] = {}
    runs = [[(root, ex) for root, ex in examples if not ex.explicit]] + [
        [(r, ex)] for r, ex in examples if ex.explicit
    ]
    for batch in runs:
        if not batch:
            continue
        explicit = batch[0][1].explicit
        proc = None
        if server != "none":
            if not ports_free():
                sys.exit("ports 8000-8002 are in use: stop what listens there first")
            log = logs / f"{server}-{Path(batch[0][1].path).stem if explicit else 'default'}.log"
            proc = start_server(server, repos[explicit], bool(explicit), log)
        try:
            if not wait_ready(READY_TIMEOUT_S, proc):
                for _, ex in batch:
                    results[ex.label] = ("FAIL", "server never became ready")
                continue
            for root, ex in batch:
                results[ex.label] = run_example(root / ex.path, timeout_s, ex.args)
                print(f"{server:7} {results[ex.label][0]:8} {ex.label}", flush=True)
        finally:
            if proc is not None:
                stop_server(proc)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--client", type=Path, help="a triton-inference-server/client checkout")
    parser.add_argument(
        "--python-backend", type=Path, help="a triton-inference-server/python_backend checkout"
    )
    parser.add_argument(
        "--servers", default="sluice,triton", help="comma-separated: sluice, triton, none"
    )
    parser.add_argument("--only", default="", help="run only examples whose path contains this")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    examples = [(args.client, ex) for ex in CLIENT_EXAMPLES if args.client] + [
        (args.python_backend, ex) for ex in PB_EXAMPLES if args.python_backend
    ]
    examples = [(root, ex) for root, ex in examples if args.only in ex.path]
    servers = args.servers.split(",")
    with tempfile.TemporaryDirectory(prefix="triton-examples-") as tmp:
        repos = {(): build_repository(Path(tmp) / "models", args.python_backend)}
        for _, ex in examples:
            if ex.explicit:
                repos[ex.explicit] = build_repository(
                    Path(tmp) / f"explicit{len(repos)}", args.python_backend, ex.explicit
                )
        columns = {s: run_suite(s, examples, repos, args.timeout_s, Path(tmp)) for s in servers}
        for log in sorted(Path(tmp).glob("*.log")):
            shutil.copy(log, Path(tempfile.gettempdir()) / f"triton-examples-{log.name}")
    print("\n| example | " + " | ".join(servers) + " |\n|---|" + "---|" * len(servers))
    for _, ex in examples:
        print(f"| {ex.label} | " + " | ".join(columns[s][ex.label][0] for s in servers) + " |")
    for ex in SKIPPED:
        print(f"| {ex.path} | " + " | ".join(f"skipped ({ex.skip})" for _ in servers) + " |")
    for s in servers:
        passed = sum(1 for status, _ in columns[s].values() if status == "pass")
        print(f"{s}: {passed}/{len(columns[s])} pass")
        for path, (status, last) in columns[s].items():
            if status != "pass":
                print(f"  {s} {status} {path}: {last}")


if __name__ == "__main__":
    main()
