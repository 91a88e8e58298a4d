"""The fleet's CPU and GPU samples, read from the workers' heartbeats, as Triton's families.

CPU series carry a `worker` label: Triton's have none, and every worker reports its own host.
GPU series carry `gpu_uuid` alone, as Triton's do: a GPU's UUID is unique across hosts, and
perf_analyzer only reads lines whose sole label is `gpu_uuid`. Workers sharing a GPU report
the same device, so its gauges come from the freshest sample and `nv_energy_consumption` from
the largest, i.e. joules since the oldest live worker on that GPU started.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from sluice.gateway.triton_exposition import Family, Value
from sluice.shared import device_metrics as dm
from sluice.shared.registry import Member


def _numbers(sample: Any) -> Iterator[tuple[str, Value]]:
    """The numeric fields of a sample; anything else a heartbeat carries is skipped."""
    if not isinstance(sample, dict):
        return
    for name, value in sample.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield name, value


def _families(specs: tuple[dm.DeviceFamily, ...]) -> dict[str, Family]:
    return {spec.name: Family(spec.name, spec.kind, spec.help) for spec in specs}


def device_families(members: Iterable[Member]) -> list[Family]:
    """Only families with samples: without a GPU in the fleet the GPU series are absent."""
    cpu = _families(dm.CPU_FAMILIES)
    freshest: dict[str, tuple[int, dict[str, Value]]] = {}
    energy: dict[str, Value] = {}
    for member in sorted(members, key=lambda m: m.id):
        sampled = member.info.get(dm.INFO_KEY) if member.kind == "worker" else None
        if not isinstance(sampled, dict):
            continue
        for name, value in _numbers(sampled.get("cpu")):
            if name in cpu:
                cpu[name].add({"worker": member.id}, value)
        at_ms = sampled.get("at_ms", 0)
        gpus = sampled.get("gpus")
        for uuid, sample in gpus.items() if isinstance(gpus, dict) else ():
            values = dict(_numbers(sample))
            if uuid not in freshest or at_ms > freshest[uuid][0]:
                freshest[uuid] = (at_ms, values)
            joules = values.get(dm.GPU_ENERGY.name)
            if joules is not None:
                energy[uuid] = max(joules, energy.get(uuid, joules))
    gpu = _families(dm.GPU_FAMILIES)
    price = _prices(members)
    for uuid, (_, values) in sorted(freshest.items()):
        if uuid in energy:
            values[dm.GPU_ENERGY.name] = energy[uuid]
        for name, value in values.items():
            if name in gpu:
                gpu[name].add({"gpu_uuid": str(uuid)}, value)
    return [f for f in (*gpu.values(), *cpu.values(), price) if f.samples]


def _prices(members: Iterable[Member]) -> Family:
    """One series per worker that was given a price (sluice tune prints the one it used)."""
    family = Family(dm.WORKER_PRICE.name, dm.WORKER_PRICE.kind, dm.WORKER_PRICE.help)
    for member in sorted(members, key=lambda m: m.id):
        price = member.info.get(dm.PRICE_KEY) if member.kind == "worker" else None
        if isinstance(price, int | float) and not isinstance(price, bool):
            family.add({"worker": member.id}, price)
    return family
