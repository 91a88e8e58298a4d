"""`sluice serve` from a non-editable install, started in the repository root: the checkout's own
`sluice/` folder (which has no gateway, shared or workers: the install maps them in) must not shadow
the installed package in the processes serve starts."""

from __future__ import annotations

import subprocess
import sysconfig
import venv
from pathlib import Path

from tests.conftest import HERE, free_ports, wait_until
from tests.test_serve_lifecycle import _infer_ones, _ready

ROOT = HERE.parent


def _installed_tree(site: Path) -> None:
    """The package as a wheel lays it out: sluice/ holding gateway, shared and workers."""
    package = site / "sluice"
    package.mkdir(parents=True)
    for item in (ROOT / "sluice").iterdir():
        (package / item.name).symlink_to(item)
    for folder in ("gateway", "shared", "workers"):
        (package / folder).symlink_to(ROOT / folder)


def _bare_python(where: Path, site: Path) -> Path:
    """A venv that sees the installed tree, then this environment's dependencies, but not the
    editable install's finder (a `.pth` path line does not run the `.pth` files it names)."""
    venv.create(where, with_pip=False)
    (site_packages,) = where.glob("lib/python3*/site-packages")
    (site_packages / "deps.pth").write_text(f"{site}\n{sysconfig.get_paths()['purelib']}\n")
    return where / "bin" / "python"


def test_serve_from_repository_root_with_installed_package(
    tmp_path: Path, model_repo: Path
) -> None:
    site = tmp_path / "site"
    _installed_tree(site)
    python = _bare_python(tmp_path / "venv", site)
    # the console script's way in: its own folder, not the working directory, leads sys.path
    script = tmp_path / "bin" / "sluice"
    script.parent.mkdir()
    script.write_text("import sys\nfrom sluice.cli import main\nsys.exit(main())\n")
    http_port, metrics_port, grpc_port = free_ports(3)
    command = [str(python), str(script), "serve", "--model-repository", str(model_repo)]
    command += ["--http-port", str(http_port), "--metrics-port", str(metrics_port)]
    command += ["--grpc-port", str(grpc_port), "--bulk-workers", "0"]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        url = f"127.0.0.1:{http_port}"
        wait_until(lambda: _ready(url) or process.poll() is not None, "serve to be ready")
        assert _infer_ones(url) is not None
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=60)
    assert "No module named" not in output
