"""Repository scanning and version selection, on temporary repositories with dummy model files."""

from __future__ import annotations

from pathlib import Path

import pytest
from sluice.shared.errors import ModelConfigError
from sluice.shared.repository import scan_repository, select_versions

IO = """
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def add_model(
    repo: Path,
    name: str,
    config: str,
    versions: tuple[str, ...] = ("1",),
    filename: str = "model.pt",
) -> Path:
    model_dir = repo / name
    model_dir.mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(config + IO)
    for version in versions:
        (model_dir / version).mkdir()
        (model_dir / version / filename).write_bytes(b"not a real model")
    return model_dir


def version_dirs(tmp_path: Path, *names: str) -> Path:
    for name in names:
        (tmp_path / name).mkdir()
    (tmp_path / "7").write_text("a file, not a version directory")
    return tmp_path


def test_select_versions_ignores_non_versions(tmp_path: Path) -> None:
    model_dir = version_dirs(tmp_path, "1", "3", "10", "01", "0", "abc", "2x")
    assert select_versions(model_dir, ("latest", (1,))) == (10,)
    assert select_versions(model_dir, ("latest", (2,))) == (3, 10)
    assert select_versions(model_dir, ("latest", (5,))) == (1, 3, 10)
    assert select_versions(model_dir, ("all", ())) == (1, 3, 10)
    assert select_versions(model_dir, ("specific", (3, 1))) == (1, 3)


def test_select_missing_specific_version(tmp_path: Path) -> None:
    model_dir = version_dirs(tmp_path, "1", "01")
    with pytest.raises(ModelConfigError, match=r"version_policy.specific: versions \[2\]"):
        select_versions(model_dir, ("specific", (1, 2)))


def test_scan_reports_bad_models_and_loads_the_rest(tmp_path: Path) -> None:
    add_model(tmp_path, "good", 'backend: "pytorch" max_batch_size: 8 dynamic_batching {}')
    add_model(
        tmp_path,
        "many",
        'backend: "pytorch" version_policy { latest { num_versions: 2 } }',
        versions=("1", "2", "3", "01", "abc"),
    )
    add_model(tmp_path, "py", 'backend: "python"', filename="model.py")
    add_model(tmp_path, "nofile", 'backend: "pytorch" version_policy { all {} }', filename="x.pt")
    add_model(tmp_path, "badcfg", 'backend: "pytorch" max_batch_size: "x"')
    add_model(tmp_path, "noversion", 'backend: "pytorch"', versions=())
    add_model(tmp_path, "gone", 'backend: "pytorch" version_policy { specific { versions: 4 } }')
    (tmp_path / "empty").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "README.md").write_text("not a model")

    entries = {entry.name: entry for entry in scan_repository(tmp_path)}
    assert list(entries) == sorted(entries)
    assert set(entries) == {"badcfg", "empty", "gone", "good", "many", "nofile", "noversion", "py"}

    good = entries["good"]
    assert (good.error, good.versions, good.path) == (None, (1,), tmp_path / "good")
    assert good.spec is not None
    assert good.spec.batching.preferred_batch_sizes == (8,)
    assert (entries["many"].error, entries["many"].versions) == (None, (2, 3))
    assert (entries["py"].error, entries["py"].versions) == (None, (1,))

    nofile = entries["nofile"]
    assert nofile.spec is not None
    assert nofile.versions == (1,)
    assert nofile.error == f"model file not found: {tmp_path / 'nofile' / '1' / 'model.pt'}"

    badcfg = entries["badcfg"]
    assert badcfg.spec is None
    assert badcfg.error is not None
    assert "config.pbtxt:1:" in badcfg.error

    # no config.pbtxt and no model file to tell the backend by (Triton's autofill finds none)
    assert entries["empty"].error is not None
    assert "Could not determine backend for model" in entries["empty"].error
    assert entries["empty"].spec is None
    assert entries["noversion"].error is not None
    assert "no version directory" in entries["noversion"].error
    assert entries["gone"].error is not None
    assert "versions [4]" in entries["gone"].error
