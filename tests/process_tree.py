"""A process and its descendants, read from /proc: to check that a stop leaves nothing."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    stack = [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:  # the task ended meanwhile
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    stack.append(child)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie, ended but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def rss_mb(pid: int) -> float:
    """The memory the process holds (resident set), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")
