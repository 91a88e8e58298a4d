"""Loaded with `-p tests.crash_report` before output capture starts: a crash of the test
process (SIGSEGV in a native library, say) dumps every thread's stack to the real stderr.

pytest's own faulthandler writes to the stderr it sees at configure time, which capture has
already redirected to a temporary file that the crash discards.
"""

from __future__ import annotations

import faulthandler
import os

import pytest

_STDERR = os.dup(2)


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    faulthandler.enable(file=_STDERR, all_threads=True)
