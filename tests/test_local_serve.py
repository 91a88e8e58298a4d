"""`sluice status` and `sluice jobs` without --redis-url find the local `sluice serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import orjson

from tests.conftest import start_service, stop_service


def _sluice(runtime: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`sluice ...` as a user types it: no SLUICE_REDIS_URL, output to a pipe (not a tty)."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("SLUICE_REDIS_URL", None)
    command = [sys.executable, "-m", "sluice", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)


NONE_RUNNING = "no sluice serve is running on this machine"


def test_status_and_jobs_find_the_local_serve_and_say_when_none_runs(
    model_repo: Path, tmp_path: Path
) -> None:
    serve = start_service(
        ["--model-repository", str(model_repo), "--bulk-workers", "0"],
        {"XDG_RUNTIME_DIR": str(tmp_path)},
    )
    try:
        [record_file] = (tmp_path / "sluice").glob("serve-*.json")
        record = json.loads(record_file.read_text())
        assert record["pid"] == serve.process.pid
        assert record["http"] == serve.http_url
        assert record["redis_url"].startswith("unix://")  # the embedded one

        status = orjson.loads(_sluice(tmp_path, "status", "--json").stdout)
        [worker] = [m for m in status["members"] if m["kind"] == "worker"]
        assert "affine" in status["models"]

        table = _sluice(tmp_path, "status")
        assert table.returncode == 0, table.stderr
        # the worker's row in the fleet table, whole on one line (heartbeat is its last column)
        [row] = [
            line for line in table.stdout.splitlines() if worker["id"] in line and "ago" in line
        ]
        assert "affine" in row
        assert len(row) > 80

        jobs = _sluice(tmp_path, "jobs", "list")
        assert (jobs.returncode, jobs.stderr) == (0, "")
    finally:
        assert stop_service(serve) == 0
    assert not record_file.exists()
    for command in (("status",), ("jobs", "list")):
        gone = _sluice(tmp_path, *command)
        assert gone.returncode == 1
        assert NONE_RUNNING in gone.stderr


def test_a_record_whose_process_is_gone_is_ignored_and_removed(tmp_path: Path) -> None:
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    pid = int(ended.stdout)
    folder = tmp_path / "sluice"
    folder.mkdir(mode=0o700)
    stale = folder / f"serve-{pid}.json"
    record = {"pid": pid, "redis_url": "redis://127.0.0.1:6379/0", "http": "127.0.0.1:8000"}
    stale.write_text(json.dumps({**record, "metrics": "127.0.0.1:8002", "started": 0.0}))
    result = _sluice(tmp_path, "status")
    assert result.returncode == 1
    assert NONE_RUNNING in result.stderr
    assert not stale.exists()


def test_an_explicit_url_wins(tmp_path: Path, redis_url: str) -> None:
    result = _sluice(tmp_path, "status", "--json", "--redis-url", redis_url)
    assert result.returncode == 0, result.stderr
    assert orjson.loads(result.stdout)["members"] == []
