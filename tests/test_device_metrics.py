"""CPU and GPU metrics as Triton names them: sampled by workers, exported by every gateway.

The CPU path runs for real (this host's /proc, a real `sluice serve`); the GPU path runs
against a test double of the NVML calls, the one part this machine cannot provide.
"""

from __future__ import annotations

import re
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import orjson
from sluice.gateway.device_families import device_families
from sluice.gateway.triton_exposition import write
from sluice.shared import keys
from sluice.shared.device_metrics import INFO_KEY
from sluice.shared.redis_client import sync_client
from sluice.shared.registry import Member
from sluice.workers.devices.device_sampler import (
    FAIL_THRESHOLD,
    CpuSampler,
    DeviceSampler,
    GpuSampler,
    open_nvml,
)

from sluice.settings import WORKER_SETTINGS_ENV
from tests.conftest import start_service, stop_service, wait_until

GPU_A = "GPU-00000000-1111-2222-3333-444444444444"
GPU_B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def _proc(root: Path, cpu_line: str, total_kb: int, available_kb: int) -> Path:
    root.mkdir(exist_ok=True)
    (root / "stat").write_text(f"{cpu_line}\ncpu0 1 2 3 4 5 6 7 8 0 0\nintr 12345\n")
    (root / "meminfo").write_text(
        f"MemTotal:       {total_kb} kB\nMemFree:         1000 kB\n"
        f"MemAvailable:   {available_kb} kB\nBuffers:          10 kB\n"
    )
    return root


def test_cpu_sample_is_computed_as_triton_computes_it(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "cpu  100 0 50 800 50 0 0 0 0 0", 16_384_000, 4_096_000)
    sampler = CpuSampler(proc)
    # user+nice+system+irq+softirq+steal rose by 80, idle+iowait by 70; guest is in user
    _proc(tmp_path, "cpu  150 5 70 860 60 2 2 1 9 9", 16_384_000, 4_096_000)
    assert sampler.sample() == {
        "nv_cpu_utilization": 80 / 150,
        "nv_cpu_memory_total_bytes": 16_384_000 * 1024,
        "nv_cpu_memory_used_bytes": (16_384_000 - 4_096_000) * 1024,
    }
    assert sampler.sample()["nv_cpu_utilization"] == 0.0  # nothing moved since


def test_cpu_sample_of_this_host() -> None:
    sample = CpuSampler().sample()
    assert 0.0 <= sample["nv_cpu_utilization"] <= 1.0
    total, used = sample["nv_cpu_memory_total_bytes"], sample["nv_cpu_memory_used_bytes"]
    assert isinstance(total, int) and isinstance(used, int)
    assert 0 < used < total


def test_no_gpu_means_no_nvml() -> None:
    assert open_nvml([]) is None
    sampler = DeviceSampler.for_this_host(2000)  # this machine has no CUDA device
    assert sampler.gpus is None and sampler.cpu is not None
    assert "pynvml" not in sys.modules


class NVMLError(Exception):
    pass


@dataclass
class Utilization:
    gpu: int


@dataclass
class Memory:
    total: int
    used: int


class FakeNvml:
    """The NVML calls the sampler makes, answering as a driver would (mW, mJ, percent)."""

    NVMLError = NVMLError

    def __init__(self) -> None:
        self.energy_mj = 5_000_000
        self.power_calls = 0
        self.shut_down = False

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid != GPU_A:
            raise NVMLError("Not Found")
        return "handle-a"

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Utilization:
        return Utilization(37)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Memory:
        return Memory(85_899_345_920, 1_073_741_824)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        self.power_calls += 1
        raise NVMLError("Not Supported")

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return self.energy_mj

    def nvmlShutdown(self) -> None:
        self.shut_down = True


def test_gpu_sample_in_triton_units_with_energy_since_start() -> None:
    nvml = FakeNvml()
    sampler = GpuSampler(nvml, [GPU_A, GPU_B])  # B is not a GPU NVML knows: skipped
    first = sampler.sample()
    assert first == {
        GPU_A: {
            "nv_gpu_utilization": 0.37,
            "nv_gpu_memory_total_bytes": 85_899_345_920,
            "nv_gpu_memory_used_bytes": 1_073_741_824,
            "nv_gpu_power_limit": 700.0,
            "nv_energy_consumption": 0.0,
        }
    }  # power usage not supported: absent, not zero
    nvml.energy_mj += 1_500
    assert sampler.sample()[GPU_A]["nv_energy_consumption"] == 1.5
    for _ in range(5):
        sampler.sample()
    assert nvml.power_calls == FAIL_THRESHOLD  # given up on after three failures in a row
    sampler.close()
    assert nvml.shut_down


def test_device_sampler_thread_publishes_the_latest_sample() -> None:
    sampler = DeviceSampler(
        0.01, CpuSampler(), GpuSampler(FakeNvml(), [GPU_A]), clock_ms=lambda: 42
    )
    sampler.start()
    try:
        wait_until(lambda: sampler.latest is not None, "a first sample", timeout_s=10)
    finally:
        sampler.stop()
    latest = sampler.latest
    assert latest is not None
    assert latest["at_ms"] == 42
    assert set(latest["cpu"]) == {
        "nv_cpu_utilization",
        "nv_cpu_memory_total_bytes",
        "nv_cpu_memory_used_bytes",
    }
    assert set(latest["gpus"]) == {GPU_A}


def _worker(member_id: str, at_ms: int, gpus: dict[str, dict[str, float]]) -> Member:
    cpu = {"nv_cpu_utilization": 0.5, "nv_cpu_memory_total_bytes": 8 << 30}
    info = {INFO_KEY: {"at_ms": at_ms, "cpu": cpu, "gpus": gpus}}
    return Member(member_id, "worker", "h", 1, at_ms, info=info)


def test_gateway_exports_one_series_per_gpu_and_per_worker_cpu() -> None:
    older = _worker(
        "w-old", 1_000, {GPU_A: {"nv_gpu_utilization": 0.1, "nv_energy_consumption": 900.5}}
    )
    newer = _worker(
        "w-new", 2_000, {GPU_A: {"nv_gpu_utilization": 0.8, "nv_energy_consumption": 12.25}}
    )
    gateway = Member("gw", "gateway", "h", 1, 2_000, info={INFO_KEY: {"cpu": {"x": 1}}})
    text = write(device_families([newer, gateway, older])).decode()
    lines = text.splitlines()
    # the GPU both workers share: the freshest gauge, the energy of the longest-lived worker
    assert f'nv_gpu_utilization{{gpu_uuid="{GPU_A}"}} 0.8' in lines
    assert f'nv_energy_consumption{{gpu_uuid="{GPU_A}"}} 900.5' in lines
    assert "# TYPE nv_energy_consumption counter" in lines
    assert "# TYPE nv_gpu_utilization gauge" in lines
    assert 'nv_cpu_utilization{worker="w-new"} 0.5' in lines
    assert 'nv_cpu_memory_total_bytes{worker="w-old"} 8589934592' in lines
    assert "nv_gpu_memory_total_bytes" not in text  # nobody sampled it
    assert 'worker="gw"' not in text
    assert device_families([_worker("w", 1, {})])[0].name == "nv_cpu_utilization"
    assert not [f for f in device_families([_worker("w", 1, {})]) if "gpu" in f.name]


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def _handed_down_settings(pid: int, variable: str) -> dict[str, Any]:
    """The settings serve handed to its child `pid` (empty for other children)."""
    prefix = f"{variable}=".encode()
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(prefix):
            return dict(orjson.loads(item.removeprefix(prefix)))
    return {}


def test_worker_heartbeat_carries_cpu_samples_and_gateway_exports_them(
    model_repo: Path, redis_url: str
) -> None:
    service = start_service(
        [
            *("--model-repository", str(model_repo), "--redis-url", redis_url),
            *("--metrics-interval-ms", "100", "--bulk-workers", "0"),
        ]
    )
    client = sync_client(redis_url)
    try:
        sampled: dict[str, Any] = {}

        def heartbeat_has_samples() -> bool:
            for blob in client.hgetall(keys.FLEET).values():
                member = msgpack.unpackb(blob)
                if member["kind"] == "worker" and (member["info"].get(INFO_KEY) or {}).get("cpu"):
                    sampled.update(member)
                    return True
            return False

        wait_until(heartbeat_has_samples, "a worker heartbeat with CPU samples")
        handed = [
            _handed_down_settings(pid, WORKER_SETTINGS_ENV)
            for pid in _children(service.process.pid)
        ]
        assert any(h.get("metrics_interval_ms") == 100 for h in handed)
        total = sampled["info"][INFO_KEY]["cpu"]["nv_cpu_memory_total_bytes"]
        assert sampled["info"][INFO_KEY]["gpus"] == {}
        url = f"http://{service.metrics_url}/metrics"
        scraped: list[str] = []

        def gateway_shows_the_worker() -> bool:  # the gateway reads the fleet once a second
            scraped[:] = [urllib.request.urlopen(url).read().decode()]
            return f'nv_cpu_utilization{{worker="{sampled["id"]}"}}' in scraped[0]

        wait_until(gateway_shows_the_worker, "the worker's CPU series on /metrics")
        text, worker = scraped[0], re.escape(sampled["id"])
        assert re.search(rf'\nnv_cpu_utilization\{{worker="{worker}"\}} (0|1|0\.\d+)\n', text)
        assert f'\nnv_cpu_memory_total_bytes{{worker="{sampled["id"]}"}} {total}\n' in text
        assert re.search(rf'\nnv_cpu_memory_used_bytes\{{worker="{worker}"\}} \d+\n', text)
        assert "nv_gpu_" not in text and "nv_energy_consumption" not in text
    finally:
        client.close()
        stop_service(service)
