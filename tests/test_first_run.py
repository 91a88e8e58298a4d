"""A newcomer's first run: the README's Python examples run as written against `sluice serve`,
and serve's log holds sluice's lines, not its libraries' chatter."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Service, start_service, stop_service, wait_until

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLES = ROOT / "examples"
#: the address the README's examples name.
README_ADDRESS = re.compile(r"(?:localhost|127\.0\.0\.1):8000")


@pytest.fixture(scope="module")
def newcomer_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """`sluice serve` as the README starts it (embedded Redis), on the example `mlp`."""
    repo = tmp_path_factory.mktemp("first-run") / "models"
    shutil.copytree(EXAMPLES / "model_repository" / "mlp", repo / "mlp")
    (repo / "mlp" / "1").mkdir(exist_ok=True)
    runpy.run_path(str(EXAMPLES / "build_models.py"))["build_mlp"](repo / "mlp" / "1")
    runtime = tmp_path_factory.mktemp("runtime")
    service = start_service(
        ["--model-repository", str(repo), "--bulk-workers", "0"],
        {"XDG_RUNTIME_DIR": str(runtime)},
    )
    yield service
    if service.process.poll() is None:
        stop_service(service)


def _python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)


def test_the_readmes_python_examples_run_as_written(
    newcomer_serve: Service, tmp_path: Path
) -> None:
    blocks = _python_blocks()
    assert len(blocks) >= 2 and any("AsyncClient" in block for block in blocks)
    for block in blocks:
        code = README_ADDRESS.sub(newcomer_serve.http_url, block)
        for _ in range(2):  # a second run with new inputs gets its own answers
            run = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                cwd=tmp_path,
                timeout=120,
            )
            assert run.returncode == 0, f"{block}\n{run.stderr}"
            assert "(1, 512)" in run.stdout
    assert list(tmp_path.iterdir()) == []


def _worker_pids(service: Service) -> set[int]:
    with urllib.request.urlopen(f"http://{service.http_url}/v2/fleet", timeout=10) as answer:
        fleet = json.loads(answer.read())
    return {m["pid"] for m in fleet["members"] if m["kind"] == "worker" and m["models"]}


def test_serve_logs_no_grpc_fork_lines_when_it_starts_a_worker_again(
    newcomer_serve: Service,
) -> None:
    [first] = _worker_pids(newcomer_serve)
    os.kill(first, signal.SIGKILL)  # serve starts another, its gRPC server long running
    wait_until(lambda: _worker_pids(newcomer_serve) - {first} != set(), "a new worker")
    assert stop_service(newcomer_serve) == 0
    log = "".join(newcomer_serve.log)
    assert f"worker 0 (pid {first}) exited with -9; restarting" in log
    assert "fork_posix" not in log
    assert "fork()" not in log


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="no tensorflow")
def test_loading_the_tensorflow_backend_keeps_tensorflows_info_lines_out(
    tmp_path: Path,
) -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPP_")}
    code = (
        "from pathlib import Path\n"
        "from tritonclient.grpc.model_config_pb2 import ModelConfig\n"
        "from sluice.workers.backends import complete_config\n"
        "config = ModelConfig(name='m', platform='tensorflow_savedmodel')\n"
        "complete_config(config, Path('.'))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environment,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    assert "cpu_feature_guard" not in run.stderr
