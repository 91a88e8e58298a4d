"""A long-running process settles its garbage collector once it has started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SETTLE = """
import gc
from sluice.shared.gc_tuning import YOUNG_OBJECTS, settle_after_startup
kept = [{} for _ in range(1000)]
before = gc.get_threshold()
settle_after_startup()
print(gc.get_freeze_count() >= len(kept), gc.get_threshold() == (YOUNG_OBJECTS, *before[1:]))
"""


def test_startup_objects_are_frozen_and_young_collections_come_less_often() -> None:
    # in a child process: the test runner's own collector stays as it is
    out = subprocess.run(
        [sys.executable, "-c", SETTLE], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.split() == ["True", "True"]
