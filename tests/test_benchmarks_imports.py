"""benchmarks/ scripts import each other and the tests' helpers: those imports form no cycle.

Each script puts benchmarks/ and the repository root on sys.path and imports its siblings by
bare name (`compare_triton`) and the tests' helpers as `tests.*`; a cycle among them (even one
only a type checker follows, under TYPE_CHECKING) makes the order of imports matter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
TESTS = ROOT / "tests"


def _modules() -> dict[str, Path]:
    """Every module of benchmarks/ (by the bare name its siblings use) and of tests/."""
    found = {path.stem: path for path in BENCHMARKS.glob("*.py")}
    found |= {f"tests.{path.stem}": path for path in TESTS.glob("*.py")}
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules `path` imports anywhere in it, TYPE_CHECKING blocks and functions too."""
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            named.add(node.module)
            named |= {f"{node.module}.{alias.name}" for alias in node.names}
    return named & known.keys()


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            found = visit(imported, [*path, module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(graph):
        found = visit(module, [])
        if found:
            return found
    return None


def test_benchmarks_and_test_helpers_import_no_cycle() -> None:
    known = _modules()
    graph = {name: _imports(path, known) for name, path in known.items()}
    assert graph["soak"] >= {"soak_report", "soak_tally"}  # the walk sees bare sibling names
    assert "tests.conftest" in graph["chaos"]  # and the tests' helpers
    assert graph["compare_peers"] >= {"compare_triton", "peer_load", "peer_report", "peer_servers"}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_every_benchmarks_module_imports() -> None:
    """As the scripts run them: benchmarks/ and the root on sys.path, one fresh interpreter.

    A module whose third-party package (an extra such as [bench]) is not installed here is
    passed over; a missing module of the repository's own is a failure.
    """
    names = sorted(path.stem for path in BENCHMARKS.glob("*.py"))
    own = sorted({*names, "sluice", "tests"})
    code = (
        f"import sys; sys.path[:0] = [{str(BENCHMARKS)!r}, {str(ROOT)!r}]\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ModuleNotFoundError as e:\n"
        f"        if (e.name or '').split('.')[0] in {own!r}:\n"
        "            raise\n"
        "        print(name, 'needs', e.name)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_peer_comparison_imports_no_peer_here() -> None:
    """compare_peers runs from sluice's own venv: the peers live in venvs of their own (--setup)."""
    peers = ["ray", "bentoml", "litserve", "pytriton"]
    code = (
        f"import sys; sys.path[:0] = [{str(BENCHMARKS)!r}, {str(ROOT)!r}]\n"
        "import compare_peers\n"
        f"print(sorted(set({peers!r}) & set(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
