"""The data path's layers: sluice.shared imports neither side; the gateway and the workers
never import each other; inside the workers, the instance side knows nothing of the queues, the
queues nothing of the models' lifecycle, and nothing of the worker that composes them; no
modules import each other in a circle. A module-level, function-level or type-checking import
breaks it alike."""

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

#: the workers' folders by layer: a folder imports only from its layer and those below. 0: what
#: runs a batch (instances and their kinds, backends, devices); 1: a model's queue (batching,
#: answers, generation, recovery); 2: which models are served (models); 3: the worker itself
#: (workers/*.py).
WORKER_LAYERS = {
    "instances": 0,
    "backends": 0,
    "python_backend": 0,
    "devices": 0,
    "batching": 1,
    "answers": 1,
    "generation": 1,
    "recovery": 1,
    "sequences": 1,
    "models": 2,
}
TOP_LAYER = 3


def _imports(path: Path) -> set[str]:
    """The modules `path` imports, and for `from m import n` also `m.n` (a submodule, if
    `n` is one)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _module_paths() -> dict[str, Path]:
    """Every module of the three packages by its import name."""
    modules = {}
    for folder in FORBIDDEN:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(("sluice", *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return modules


def _circle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """An import path from `start` back to itself, if there is one."""
    paths = [[start]]
    seen = {start}
    while paths:
        path = paths.pop()
        for name in sorted(graph[path[-1]]):
            if name == start:
                return [*path, start]
            if name not in seen:
                seen.add(name)
                paths.append([*path, name])
    return None


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


def test_no_modules_import_each_other_in_a_circle() -> None:
    """A circle hides which module comes first, and lasts only while one of its imports is
    deferred."""
    modules = _module_paths()
    graph = {
        name: {other for other in _imports(path) if other in modules and other != name}
        for name, path in modules.items()
    }
    circles = [c for c in (_circle_from(name, graph) for name in sorted(graph)) if c is not None]
    assert circles == []


def _worker_layer(module: str) -> int:
    """The layer of a module of sluice.workers."""
    folder = module.split(".")[2]
    return WORKER_LAYERS.get(folder, TOP_LAYER)


def test_worker_folders_import_only_their_layer_and_those_below() -> None:
    assert sorted(WORKER_LAYERS) == sorted(
        p.name for p in (ROOT / "workers").iterdir() if p.is_dir() and (p / "__init__.py").exists()
    )
    workers = {n: p for n, p in _module_paths().items() if n.startswith("sluice.workers.")}
    upward = [
        f"{path.relative_to(ROOT)} imports {name}"
        for module, path in sorted(workers.items())
        for name in sorted(_imports(path))
        if name in workers and _worker_layer(name) > _worker_layer(module)
    ]
    assert upward == []
