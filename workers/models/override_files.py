"""A load's `file:` overrides on a worker's disk, only ever below the worker's own directory.

The model name and the file paths come from the wire (through Redis), so every directory made
or removed here is resolved first and must lie below that directory: a name that slipped past
the gateways, a stored desired state written straight to Redis, or a link planted in the
directory cannot make a worker write or delete anything else.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from sluice.shared.repository_control import model_name_problem, override_path


class OverrideDirectory:
    """The worker's private directory of overrides: `g<generation>/<model>/` per load."""

    def __init__(self, worker_id: str) -> None:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id)[:64]
        # mkdtemp: a fresh directory only this user can enter, never one planted beforehand
        self.root = Path(tempfile.mkdtemp(prefix=f"sluice-overrides-{safe}-")).resolve()

    def for_load(self, generation: int, name: str) -> Path:
        """Where a load's files go; ValueError for a name that is no model directory."""
        if (problem := model_name_problem(name)) is not None:
            raise ValueError(f"model files not written: {problem}")
        return self._inside(self.root / f"g{int(generation)}" / name)

    def write(self, model_dir: Path, files: Mapping[str, bytes]) -> None:
        """The load's files as a fresh model directory (what an earlier try left is removed)."""
        self.discard(model_dir)
        for parameter, content in files.items():
            target = self._inside(model_dir / override_path(parameter))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        model_dir.mkdir(parents=True, exist_ok=True)

    def discard(self, model_dir: Path | None) -> None:
        """Remove a load's files (nothing outside the worker's directory, whatever is asked)."""
        if model_dir is not None:
            shutil.rmtree(self._inside(model_dir), ignore_errors=True)

    def remove_all(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _inside(self, path: Path) -> Path:
        resolved = path.resolve()
        if resolved == self.root or not resolved.is_relative_to(self.root):
            raise ValueError(f"'{path}' is outside the worker's override directory")
        return resolved
