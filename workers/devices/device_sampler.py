"""The host's CPU and memory, and the GPUs this worker sees, sampled on a thread of their own.

Figures are computed as Triton computes them (`/proc/stat`, `/proc/meminfo`, NVML), so that
dashboards built on Triton's nv_cpu_* / nv_gpu_* read the same. The heartbeat reads the last
sample; nothing here touches the batches' path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from sluice.shared import device_metrics as dm
from sluice.shared.registry import now_ms

log = logging.getLogger(__name__)

Sample = dict[str, float | int]
#: a field that failed this many reads in a row is no longer read (Triton's threshold too).
FAIL_THRESHOLD = 3


class CpuSampler:
    """Host-wide CPU use since the previous sample, and memory in use, from /proc."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._last = self._cpu_times()

    @classmethod
    def open(cls, proc: Path = Path("/proc")) -> CpuSampler | None:
        try:
            return cls(proc)
        except (OSError, ValueError) as exc:  # not Linux, or /proc not mounted
            log.warning("CPU metrics off: cannot read %s/stat (%s)", proc, exc)
            return None

    def _cpu_times(self) -> tuple[int, int]:
        """(busy, idle) jiffies of the aggregate `cpu` line, split as Triton splits them."""
        with open(self._proc / "stat", "rb") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
        return user + nice + system + irq + softirq + steal, idle + iowait

    def _meminfo_bytes(self) -> tuple[int, int]:
        """(MemTotal, MemAvailable) in bytes."""
        found: dict[bytes, int] = {}
        with open(self._proc / "meminfo", "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                if key in (b"MemTotal", b"MemAvailable"):
                    found[key] = int(rest.split()[0]) * 1024
                    if len(found) == 2:
                        break
        return found[b"MemTotal"], found[b"MemAvailable"]

    def sample(self) -> Sample:
        busy, idle = self._cpu_times()
        d_busy, d_idle = busy - self._last[0], idle - self._last[1]
        self._last = (busy, idle)
        total, available = self._meminfo_bytes()
        return {
            dm.CPU_UTILIZATION.name: d_busy / (d_busy + d_idle) if d_busy + d_idle > 0 else 0.0,
            dm.CPU_MEMORY_TOTAL.name: total,
            dm.CPU_MEMORY_USED.name: total - available,
        }


class Nvml(Protocol):
    """The part of nvidia-ml-py's `pynvml` read here."""

    NVMLError: type[Exception]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int: ...
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int: ...
    def nvmlShutdown(self) -> None: ...


class GpuSampler:
    """NVML readings of the given GPUs in Triton's units; a field NVML cannot read is left
    out of the sample (absent, not zero), and after FAIL_THRESHOLD failures in a row no
    longer asked for."""

    def __init__(self, nvml: Nvml, uuids: list[str]) -> None:
        self._nvml = nvml
        self._handles: dict[str, Any] = {}
        for uuid in uuids:
            try:
                self._handles[uuid] = nvml.nvmlDeviceGetHandleByUUID(uuid)
            except nvml.NVMLError as exc:
                log.warning("no metrics for GPU %s: NVML does not know it (%s)", uuid, exc)
        #: total energy (mJ since the driver loaded) at the first read: the counter's zero.
        self._energy_base: dict[str, int] = {}
        self._failures: dict[tuple[str, str], int] = {}

    def _fields(self, uuid: str, handle: Any) -> dict[str, Callable[[], float | int]]:
        nvml = self._nvml

        def energy_j() -> float:
            total_mj = nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            return (total_mj - self._energy_base.setdefault(uuid, total_mj)) / 1000

        return {
            dm.GPU_UTILIZATION.name: lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100,
            dm.GPU_MEMORY_TOTAL.name: lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
            dm.GPU_MEMORY_USED.name: lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).used),
            dm.GPU_POWER_USAGE.name: lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
            dm.GPU_POWER_LIMIT.name: lambda: nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000,
            dm.GPU_ENERGY.name: energy_j,
        }

    def sample(self) -> dict[str, Sample]:
        samples: dict[str, Sample] = {}
        for uuid, handle in self._handles.items():
            sample: Sample = {}
            for name, read in self._fields(uuid, handle).items():
                key = (uuid, name)
                failures = self._failures.get(key, 0)
                if failures >= FAIL_THRESHOLD:
                    continue
                try:
                    sample[name] = read()
                    self._failures[key] = 0
                except self._nvml.NVMLError as exc:
                    self._failures[key] = failures + 1
                    if failures + 1 == FAIL_THRESHOLD:
                        log.warning("%s of GPU %s: no longer read (%s)", name, uuid, exc)
            samples[uuid] = sample
        return samples

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            log.warning("NVML shutdown: %s", exc)


def cuda_gpu_uuids() -> list[str]:
    """NVML's names of the GPUs CUDA lets this process use (CUDA_VISIBLE_DEVICES applied)."""
    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    return [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(count)]


def open_nvml(uuids: list[str]) -> GpuSampler | None:
    """NVML only where there is a GPU: a CPU-only worker never imports it."""
    if not uuids:
        return None
    try:
        import pynvml
    except ImportError:
        log.warning(
            "GPU metrics off: nvidia-ml-py is not installed (pip install 'sluice-serve[gpu]')"
        )
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.warning("GPU metrics off: NVML did not start (%s)", exc)
        return None
    return GpuSampler(pynvml, uuids)


class DeviceSampler:
    """Samples every `interval_s` on its own thread; the heartbeat sends `latest`."""

    def __init__(
        self,
        interval_s: float,
        cpu: CpuSampler | None,
        gpus: GpuSampler | None,
        clock_ms: Callable[[], int] = now_ms,
    ) -> None:
        self.interval_s = interval_s
        self.cpu = cpu
        self.gpus = gpus
        self._clock_ms = clock_ms
        #: the last sample, in the heartbeat's form (shared/device_metrics.py); None before one.
        self.latest: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="device-sampler", daemon=True)

    @classmethod
    def for_this_host(cls, interval_ms: int) -> DeviceSampler:
        return cls(interval_ms / 1000, CpuSampler.open(), open_nvml(cuda_gpu_uuids()))

    def sample(self) -> dict[str, Any]:
        return {
            "at_ms": self._clock_ms(),
            "cpu": self.cpu.sample() if self.cpu is not None else {},
            "gpus": self.gpus.sample() if self.gpus is not None else {},
        }

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.latest = self.sample()
            except (OSError, ValueError, KeyError) as exc:  # a /proc read that went wrong
                log.warning("device metrics not sampled: %s", exc)

    def start(self) -> None:
        if self.cpu is not None or self.gpus is not None:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.gpus is not None:
            self.gpus.close()
