"""How many cores this process may use: the CPUs it may run on, or fewer where its cgroup's CPU
quota says so (a container's `--cpus`, a Kubernetes CPU limit)."""

from __future__ import annotations

import math
import os
from pathlib import Path

#: cgroup v2's quota and period, in microseconds ("max" for no quota).
CPU_MAX = "/sys/fs/cgroup/cpu.max"


def cores_available(cpu_max: str = CPU_MAX) -> int:
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path(cpu_max).read_text().split()
    except (OSError, ValueError):
        return cores
    if quota.isdecimal() and period.isdecimal() and int(period) > 0:
        cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    return cores
