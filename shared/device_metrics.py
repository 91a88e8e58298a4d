"""Triton's CPU and GPU metric families, and how a worker's samples ride in its heartbeat.

Workers sample, gateways export: both sides name the figures by these families, so a sample
is a plain mapping from a Triton metric name to a number, msgpack-ready.

In a heartbeat's `info`, under INFO_KEY:
`{"at_ms": <when sampled>, "cpu": {name: value}, "gpus": {gpu_uuid: {name: value}}}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

INFO_KEY = "device_metrics"
#: a worker's `--price-per-hour`, in its heartbeat's `info` when set (dashboards' cost panel)
PRICE_KEY = "price_per_hour"


@dataclass(frozen=True, slots=True)
class DeviceFamily:
    name: str
    kind: Literal["counter", "gauge"]
    help: str


CPU_UTILIZATION = DeviceFamily("nv_cpu_utilization", "gauge", "CPU utilization rate [0.0 - 1.0]")
CPU_MEMORY_TOTAL = DeviceFamily(
    "nv_cpu_memory_total_bytes", "gauge", "CPU total memory (RAM), in bytes"
)
CPU_MEMORY_USED = DeviceFamily(
    "nv_cpu_memory_used_bytes", "gauge", "CPU used memory (RAM), in bytes"
)
CPU_FAMILIES = (CPU_UTILIZATION, CPU_MEMORY_TOTAL, CPU_MEMORY_USED)
WORKER_PRICE = DeviceFamily(
    "sluice_worker_price_per_hour",
    "gauge",
    "What this worker costs per hour (its --price-per-hour), for cost per inference",
)

GPU_UTILIZATION = DeviceFamily("nv_gpu_utilization", "gauge", "GPU utilization rate [0.0 - 1.0)")
GPU_MEMORY_TOTAL = DeviceFamily("nv_gpu_memory_total_bytes", "gauge", "GPU total memory, in bytes")
GPU_MEMORY_USED = DeviceFamily("nv_gpu_memory_used_bytes", "gauge", "GPU used memory, in bytes")
GPU_POWER_USAGE = DeviceFamily("nv_gpu_power_usage", "gauge", "GPU power usage in watts")
GPU_POWER_LIMIT = DeviceFamily("nv_gpu_power_limit", "gauge", "GPU power management limit in watts")
GPU_ENERGY = DeviceFamily(
    "nv_energy_consumption",
    "counter",
    "GPU energy consumption in joules since the Triton Server started",
)
GPU_FAMILIES = (
    GPU_UTILIZATION,
    GPU_MEMORY_TOTAL,
    GPU_MEMORY_USED,
    GPU_POWER_USAGE,
    GPU_POWER_LIMIT,
    GPU_ENERGY,
)
