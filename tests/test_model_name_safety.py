"""A model name from the wire is one directory name: a load under any other is refused at the
gateway, and a worker writes and removes a load's files only below its own directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sluice.shared.errors import InvalidInput
from sluice.shared.model_loads import check_load
from sluice.shared.repository_control import model_name_problem
from sluice.workers.models.override_files import OverrideDirectory

CONFIG = '{"backend": "python"}'
FILES = {"file:1/x": b"x"}
BAD_NAMES = ["", ".", "..", "/srv/victim", "a/b", "../x", "a\\b", "..\\..", "a\0b", "m" * 256]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_load_under_a_name_that_is_no_directory_is_refused(name: str) -> None:
    assert model_name_problem(name) is not None
    for files in (FILES, None):  # with or without files: a worker makes it a directory
        with pytest.raises(InvalidInput, match="load failed for model"):
            check_load(name, CONFIG, files)


@pytest.mark.parametrize("name", ["m", "my-model_2.onnx", "..m", "a b", "é" * 127])
def test_names_of_one_path_component_are_models(name: str) -> None:
    assert model_name_problem(name) is None
    check_load(name, CONFIG, FILES)


@pytest.fixture
def overrides() -> Iterator[OverrideDirectory]:
    directory = OverrideDirectory("worker/1:2")
    yield directory
    directory.remove_all()


def test_the_override_directory_is_private_and_fresh(overrides: OverrideDirectory) -> None:
    assert overrides.root.is_dir() and overrides.root.stat().st_mode & 0o077 == 0
    other = OverrideDirectory("worker/1:2")  # the same worker id again: another directory
    try:
        assert other.root != overrides.root
    finally:
        other.remove_all()


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_worker_makes_no_directory_for_a_bad_name(
    overrides: OverrideDirectory, name: str
) -> None:
    with pytest.raises(ValueError):
        overrides.for_load(3, name)


def test_a_loads_files_are_written_and_removed_below_the_directory(
    overrides: OverrideDirectory,
) -> None:
    target = overrides.for_load(3, "m")
    overrides.write(target, {"file:1/model.py": b"code", "file:config.pbtxt": b"c"})
    assert (target / "1" / "model.py").read_bytes() == b"code"
    assert target.is_relative_to(overrides.root)
    overrides.discard(target)
    assert not target.exists() and overrides.root.is_dir()


def test_nothing_outside_the_directory_is_written_or_removed(
    overrides: OverrideDirectory, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    (victim / "keep").mkdir(parents=True)
    for outside in (victim, overrides.root, overrides.root / ".." / victim.name, Path("/")):
        with pytest.raises(ValueError, match="outside"):
            overrides.discard(outside)
    planted = overrides.root / "g1"  # a link planted where a load's files would go
    planted.symlink_to(victim, target_is_directory=True)
    with pytest.raises(ValueError, match="outside"):
        overrides.for_load(1, "keep")
    with pytest.raises(ValueError, match="outside"):
        overrides.discard(planted / "keep")
    with pytest.raises(ValueError, match="outside"):
        overrides.write(planted / "keep", {"file:1/x": b"x"})
    assert (victim / "keep").is_dir()
