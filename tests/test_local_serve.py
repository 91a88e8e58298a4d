"""`sluice status` and `sluice jobs` without --redis-url find the local `sluice serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import click
import orjson
import pytest

from sluice.runtime_file import ServeRecord, choose_serve
from tests.conftest import start_service, stop_service


def _sluice(
    runtime: Path, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`sluice ...` as a user types it: no SLUICE_REDIS_URL, output to a pipe (not a tty)."""
    environment = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), **(env or {})}
    environment.pop("SLUICE_REDIS_URL", None)
    command = [sys.executable, "-m", "sluice", *args]
    return subprocess.run(
        command, capture_output=True, text=True, env=environment, cwd=cwd, timeout=60
    )


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
        assert record["repository"] == str(model_repo.resolve())

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


@pytest.fixture
def live_pids() -> Iterator[list[int]]:
    """Two live processes that pass for serves (pids are checked against /proc), ended after."""
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()", "sluice"], stdin=subprocess.PIPE
        )
        for _ in range(2)
    ]
    yield [holder.pid for holder in holders]
    for holder in holders:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)


def _record(runtime: Path, pid: int, redis_url: str, repository: Path, started: float) -> None:
    folder = runtime / "sluice"
    folder.mkdir(mode=0o700, exist_ok=True)
    record = ServeRecord(
        pid, redis_url, "127.0.0.1:8000", "127.0.0.1:8002", started, str(repository)
    )
    (folder / f"serve-{pid}.json").write_text(json.dumps(asdict(record)))


def test_with_several_serves_the_one_of_the_working_directory_is_taken_else_none_is_guessed(
    tmp_path: Path, redis_url: str, live_pids: list[int]
) -> None:
    runtime, projects = tmp_path / "run", tmp_path / "projects"
    runtime.mkdir()
    ours, other = projects / "ours" / "models", projects / "other" / "models"
    for folder in (ours / "mlp" / "1", other):
        folder.mkdir(parents=True)
    # the other serve is the newer one, and its Redis is down and has a password
    _record(runtime, live_pids[0], redis_url, ours, started=1_000.0)
    _record(runtime, live_pids[1], "redis://:s3cret@127.0.0.1:1/0", other, started=2_000.0)

    inside = _sluice(runtime, "status", "--json", cwd=ours / "mlp" / "1")
    assert inside.returncode == 0, inside.stderr
    assert orjson.loads(inside.stdout)["members"] == []
    assert f"using the sluice serve of {ours} (pid {live_pids[0]}" in inside.stderr

    jobs = _sluice(runtime, "jobs", "list", cwd=projects / "ours")  # the checkout holding it
    assert jobs.returncode == 0, jobs.stderr

    between = _sluice(runtime, "status", "--json", cwd=projects)
    assert between.returncode == 1
    assert between.stdout == ""
    assert "2 sluice serve processes run on this machine" in between.stderr
    assert "--serve-pid PID (or SLUICE_SERVE_PID), or with --redis-url URL" in between.stderr
    [first, second] = [line for line in between.stderr.splitlines() if line.startswith("  pid")]
    assert first.startswith(f"  pid {live_pids[1]}  {other}  redis://:***@127.0.0.1:1/0  ")
    assert second.startswith(f"  pid {live_pids[0]}  {ours}  ")
    assert "s3cret" not in between.stderr

    by_variable = _sluice(
        runtime, "jobs", "list", cwd=projects, env={"SLUICE_SERVE_PID": str(live_pids[0])}
    )
    assert by_variable.returncode == 0, by_variable.stderr
    by_option = _sluice(runtime, "status", "--serve-pid", str(live_pids[1]), cwd=ours)
    assert by_option.returncode == 1  # the other one, whose Redis is down
    assert "Redis:" in by_option.stderr


def _serve(pid: int, repository: str) -> ServeRecord:
    return ServeRecord(pid, f"redis://h/{pid}", "h:8000", "h:8002", float(pid), repository)


def test_the_nearest_repository_wins_and_a_tie_is_no_choice() -> None:
    outer, inner, apart = _serve(1, "/p/models"), _serve(2, "/p/models/sub"), _serve(3, "/q")
    serves = [outer, inner, apart]
    assert choose_serve(serves, Path("/p/models/sub/m/1"), None) == inner  # the deepest
    assert choose_serve(serves, Path("/p/models/m"), None) == outer
    assert choose_serve(serves, Path("/"), 3) == apart
    assert choose_serve([apart], Path("/elsewhere"), None) == apart  # the only one
    for here in (Path("/p"), Path("/elsewhere")):  # holds two, or none
        with pytest.raises(click.ClickException, match="3 sluice serve processes run"):
            choose_serve(serves, here, None)
    with pytest.raises(click.ClickException, match="--serve-pid 9: no sluice serve runs"):
        choose_serve(serves, Path("/q"), 9)
    older = _serve(4, "")  # a file an older serve wrote names no repository
    assert choose_serve([older, apart], Path("/q/m"), None) == apart
