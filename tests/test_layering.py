"""The data path's layers: sluice.shared imports neither side; the gateway and the workers
never import each other. A module-level or function-level import breaks it alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: folder -> the sluice packages its modules must not import
FORBIDDEN = {
    "shared": ("sluice.gateway", "sluice.workers"),
    "gateway": ("sluice.workers",),
    "workers": ("sluice.gateway",),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_a_layer_imports_no_forbidden_layer(folder: str) -> None:
    crossings = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in sorted(_imports(path))
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN[folder])
    ]
    assert crossings == []


def test_nothing_imports_the_old_top_level_names() -> None:
    old = ("gateway", "workers", "shared")
    stray = [
        f"{path.relative_to(ROOT)} imports {name}"
        for folder in ("shared", "gateway", "workers", "sluice", "tests", "benchmarks", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in sorted(_imports(path))
        if name.split(".")[0] in old
    ]
    assert stray == []
