"""Scan a Triton-layout model repository: `<repo>/<model>/config.pbtxt` and `<N>/` version dirs.

A model without config.pbtxt is auto-completed from its files, as Triton does by default.

A bad model never stops the scan: its entry carries the reason, as Triton keeps serving the
models that load and reports the others as UNAVAILABLE with a reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import Completer, ModelSpec, load_model_config


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model directory: its spec and versions when it can load, else why not (`error`)."""

    name: str
    path: Path
    spec: ModelSpec | None
    versions: tuple[int, ...]
    error: str | None


def scan_repository(repo: Path, complete: Completer | None = None) -> list[ModelEntry]:
    """One entry per model directory (hidden ones skipped), sorted by name.

    A bad model is reported in its entry's `error` and never raises; only an unreadable
    `repo` itself does (OSError).
    """
    model_dirs = [p for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")]
    ordered = sorted(model_dirs, key=lambda p: p.name)
    return [scan_model(model_dir, complete=complete) for model_dir in ordered]


def select_versions(model_dir: Path, policy: tuple[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The versions `policy` picks among `model_dir`'s version dirs, ascending.

    Only names of digits not starting with "0" are versions (Triton ignores the rest).
    A `specific` version that has no directory is a ModelConfigError.
    """
    available = sorted(
        int(p.name)
        for p in model_dir.iterdir()
        if p.is_dir() and p.name.isdigit() and not p.name.startswith("0")
    )
    kind, numbers = policy
    if kind == "all":
        return tuple(available)
    if kind == "latest":
        return tuple(available[-numbers[0] :]) if numbers[0] > 0 else ()
    missing = sorted(set(numbers) - set(available))
    if missing:
        raise ModelConfigError(
            f"{model_dir}: version_policy.specific: versions {missing} have no directory"
        )
    return tuple(sorted(set(numbers)))


def scan_model(
    model_dir: Path, *, config_json: str | None = None, complete: Completer | None = None
) -> ModelEntry:
    """One model directory as an entry; `config_json` overrides its config.pbtxt (a load's
    config parameter), `complete` fills in what its files say (see load_model_config)."""
    name = model_dir.name
    try:
        spec = load_model_config(model_dir, config_json=config_json, complete=complete)
        versions = select_versions(model_dir, spec.version_policy)
    except (ModelConfigError, OSError) as exc:
        return ModelEntry(name, model_dir, None, (), str(exc))
    if not versions:
        return ModelEntry(name, model_dir, spec, (), f"{model_dir}: no version directory to load")
    missing = [
        str(path)
        for path in (model_dir / str(v) / spec.model_filename for v in versions)
        if not path.exists()
    ]
    error = f"model file not found: {', '.join(missing)}" if missing else None
    return ModelEntry(name, model_dir, spec, versions, error)


def model_names(repo: Path) -> list[str]:
    """The model directories of `repo` (hidden ones skipped), sorted; [] if it is unreadable."""
    try:
        return sorted(p.name for p in repo.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def fingerprint(model_dir: Path) -> tuple[tuple[str, int, int], ...]:
    """Every file and folder under `model_dir` with its mtime and size: a change of
    config.pbtxt, a version directory added or removed, or a model file rewritten changes it
    (poll mode's test). Hidden entries and Python's byte-code caches are left out, as loading
    a model may write them."""
    found = []
    for path in model_dir.rglob("*"):
        relative = path.relative_to(model_dir)
        if any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
            continue
        try:
            stat = path.stat()
        except OSError:  # removed while we looked: the next poll sees the new state
            continue
        is_file = path.is_file()
        found.append(
            (str(relative), stat.st_mtime_ns if is_file else 0, stat.st_size if is_file else -1)
        )
    return tuple(sorted(found))
