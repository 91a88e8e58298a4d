"""The calling thread's alternate signal stack, given back after a native call replaced it.

OpenVINO's CPU plugin gives the thread that compiles a model a signal stack of its own, and
unmaps it when the compiled model is freed. Freed on another thread (a garbage collection
there, an unload), it leaves the compiling thread's signal stack pointing at unmapped memory:
the next signal that thread handles (SIGTERM's drain, a timeout's SIGALRM, faulthandler's
report of a crash) kills the process with a SIGSEGV that prints nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator

_SS_ONSTACK = 1


class _SignalStack(ctypes.Structure):
    """Linux's stack_t."""

    _fields_ = [
        ("ss_sp", ctypes.c_void_p),
        ("ss_flags", ctypes.c_int),
        ("ss_size", ctypes.c_size_t),
    ]


_sigaltstack = ctypes.CDLL(None, use_errno=True).sigaltstack if sys.platform == "linux" else None


@contextlib.contextmanager
def signal_stack_kept() -> Iterator[None]:
    """Run the block, then give this thread back the signal stack it had before."""
    before = _SignalStack()
    if _sigaltstack is None or _sigaltstack(None, ctypes.byref(before)) != 0:
        yield
        return
    before.ss_flags &= ~_SS_ONSTACK  # a state sigaltstack reports, not one it takes
    try:
        yield
    finally:
        _sigaltstack(ctypes.byref(before), None)
