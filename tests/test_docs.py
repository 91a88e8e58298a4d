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

#: options of other tools the docs show next to sluice's (docker, curl, perf_analyzer, mypy).
FOREIGN_OPTIONS = {
    "--build",
    "--data-binary",
    "--concurrency-range",
    "--collect-metrics",
    "--help",
    "--strict",
}

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`([^`\n]+)`")
_FOLDERS = "gateway|workers|shared|sluice|tests|benchmarks|deploy|examples|docs"
_REPO_PATH = re.compile(rf"^(?:{_FOLDERS})/")
_OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_VARIABLE = re.compile(r"\bSLUICE_[A-Z0-9_]*[A-Z0-9]\b")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def _cli_options(hidden: bool) -> tuple[set[str], set[str]]:
    """The `--options` and `SLUICE_` variables of every sluice command: the ones --help shows,
    or the hidden former spellings."""
    flags: set[str] = set()
    variables: set[str] = set()

    def walk(command: click.Command) -> None:
        for param in command.params:
            if isinstance(param, click.Option) and param.hidden == hidden:
                flags.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
                if isinstance(param.envvar, str):
                    variables.add(param.envvar)
        if isinstance(command, click.Group):
            for sub in command.commands.values():
                walk(sub)

    walk(cli)
    return flags, variables


def _source_file_names() -> set[str]:
    return {
        path.name
        for folder in _FOLDERS.split("|")
        for path in (ROOT / folder).rglob("*.py")
        if ".venv" not in path.parts
    }


def _names_a_module(name: str) -> bool:
    """Whether a dotted `sluice.…` name starts with one of sluice's modules (`sluice.role`,
    a span attribute, does not)."""
    top = name.split(".")[1]
    return top in ("gateway", "shared", "workers") or any(
        (ROOT / "sluice" / candidate).exists() for candidate in (top, f"{top}.py")
    )


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


def _missing(word: str, source_files: set[str]) -> bool:
    """Whether a word in backticks names a path, module or source file the repository lacks."""
    if _REPO_PATH.match(word) and not re.search(r"[<>{}*$]", word):
        return not (ROOT / word.rstrip(":,")).exists()
    if re.fullmatch(r"sluice(\.\w+)+", word) and _names_a_module(word):
        return not _resolves(word)
    if re.fullmatch(r"\w+\.py", word):
        return word not in source_files
    return False


@pytest.mark.parametrize("page", PAGES[:-1], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_paths_and_modules_exist(page: Path) -> None:
    """In the README and docs/ (RESULTS.md's dated log names the code as it was then)."""
    source_files = _source_file_names()
    words = [code.split()[0] for code in _CODE.findall(page.read_text()) if code.split()]
    missing = [word for word in words if _missing(word, source_files)]
    assert not missing, f"{page.name}: {missing}"


@pytest.mark.parametrize("page", PAGES[:-1], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_documented_options_are_current(page: Path) -> None:
    """Options and variables as --help shows them; a hidden former spelling only where the
    paragraph says it is one."""
    flags, variables = _cli_options(hidden=False)
    former_flags, former_variables = _cli_options(hidden=True)
    wrong = []
    for paragraph in page.read_text().split("\n\n"):
        former_ok = "former spelling" in paragraph
        for flag in set(_OPTION.findall(paragraph)) - flags - FOREIGN_OPTIONS:
            if not (former_ok and flag in former_flags):
                wrong.append(flag)
        for variable in set(_VARIABLE.findall(paragraph)) - variables:
            if not (former_ok and variable in former_variables):
                wrong.append(variable)
    assert not wrong, f"{page.name} names options sluice does not show: {sorted(wrong)}"


def test_the_checks_catch_what_they_are_for() -> None:
    assert _slug("Batching delay: fixed or adaptive") == "batching-delay-fixed-or-adaptive"
    assert _slug("Redis Cluster, Sentinel, managed") == "redis-cluster-sentinel-managed"
    assert _slug("Fleet, 2026-11-29 (x86_64, `a.py`)") == "fleet-2026-11-29-x86_64-apy"
    assert _resolves("sluice.shared.keys.request_stream")
    assert not _resolves("sluice.shared.keys.no_such_name")
    assert {"--redis-url", "--drain-timeout-s"} <= _cli_options(hidden=False)[0]
    assert "--drain-timeout" in _cli_options(hidden=True)[0]
    assert "SLUICE_REDIS_URL" in _cli_options(hidden=False)[1]
    assert _missing("routing.py", set()) and not _missing("routing.py", {"routing.py"})
    assert _missing("shared/no_such_module.py", set())
