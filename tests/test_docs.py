"""The README and docs/ stay true: links lead somewhere, and what they name exists.

Each check reads the Markdown as a newcomer would follow it: a relative link or `#anchor`
opens a file and a heading; a repository path or `sluice.*` name in backticks is one the code
has; a `--option` is one the `sluice` command accepts.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import click
import pytest

from sluice.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]
README_MAX_LINES = 250

#: options of other tools the docs show next to sluice's (docker, curl, perf_analyzer).
FOREIGN_OPTIONS = {"--build", "--data-binary", "--concurrency-range", "--collect-metrics", "--help"}

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`\n]+)`")
_FOLDERS = "gateway|workers|shared|sluice|tests|benchmarks|deploy|examples|docs"
_REPO_PATH = re.compile(rf"^(?:{_FOLDERS})/")
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def _cli_options() -> set[str]:
    found: set[str] = set()

    def walk(command: click.Command) -> None:
        for param in command.params:
            if isinstance(param, click.Option):
                found.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
        if isinstance(command, click.Group):
            for sub in command.commands.values():
                walk(sub)

    walk(cli)
    return found


def _resolves(name: str) -> bool:
    """Whether a dotted `sluice.…` name is a module, or an attribute of one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


def test_readme_is_short_with_contents_and_limits() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "move detail to docs/"
    assert "**Contents:**" in text
    assert "## Not supported yet" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_lead_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in _LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", PAGES[:-1], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_paths_and_modules_exist(page: Path) -> None:
    """In the README and docs/ (RESULTS.md's dated log names the code as it was then)."""
    missing = []
    for code in _CODE.findall(page.read_text()):
        word = code.split()[0] if code.split() else code
        if _REPO_PATH.match(word) and not re.search(r"[<>{}*$]", word):
            if not (ROOT / word.rstrip(":,")).exists():
                missing.append(word)
        elif re.fullmatch(r"sluice(\.\w+)+", word) and not _resolves(word):
            missing.append(word)
    assert not missing, f"{page.name}: {missing}"


@pytest.mark.parametrize("page", PAGES[:-1], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_documented_options_exist(page: Path) -> None:
    known = _cli_options() | FOREIGN_OPTIONS
    unknown = sorted(set(_OPTION.findall(page.read_text())) - known)
    assert not unknown, f"{page.name} names options sluice does not have: {unknown}"


def test_the_checks_catch_what_they_are_for() -> None:
    assert _slug("Batching delay: fixed or adaptive") == "batching-delay-fixed-or-adaptive"
    assert _slug("Redis Cluster, Sentinel, managed") == "redis-cluster-sentinel-managed"
    assert _slug("Fleet, 2026-11-29 (x86_64, `a.py`)") == "fleet-2026-11-29-x86_64-apy"
    assert _resolves("sluice.shared.keys.request_stream")
    assert not _resolves("sluice.shared.keys.no_such_name")
    assert "--redis-url" in _cli_options()
