"""Where a model's instances run: Triton's `instance_group` placement, as a pure function of
the model's config and the number of GPUs the worker sees.

As in Triton: a GPU group's `count` is per GPU, on each of its `gpus` (all visible GPUs when it
lists none), instances taken count-major (`count: 2 gpus: [0, 1]` is GPU 0, 1, 0, 1); KIND_AUTO
is a GPU group when every GPU it lists is visible and there is one, else a CPU group; KIND_GPU
with no GPU, or listing one the worker cannot see, does not load, with Triton's reason.
KIND_CPU and KIND_MODEL (placement left to the backend) run on the CPU here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from sluice.shared.config_view import ConfigView, InstanceGroup
from sluice.shared.errors import ModelConfigError

CPU = torch.device("cpu")
#: Triton's TRITON_MIN_COMPUTE_CAPABILITY as its reason prints it (std::to_string(6.0)).
MIN_COMPUTE_CAPABILITY = "6.000000"


@dataclass(frozen=True, slots=True)
class Slot:
    """One instance: its group's name and kind, its number in the group and its device. Triton
    names it `<group>_<number>`; a GPU group's instances of one number, one per GPU, share it."""

    group: str
    kind: str
    number: int
    device: torch.device


def instance_slots(config: ConfigView, gpu_count: int) -> tuple[Slot, ...]:
    """Every instance, in instance order."""
    slots: list[Slot] = []
    for group in config.instance_groups:
        gpus = _group_gpus(config.name, group, gpu_count)
        devices = [CPU] if gpus is None else [torch.device("cuda", gpu) for gpu in gpus]
        for number in range(group.count):
            slots.extend(Slot(group.name, group.kind, number, device) for device in devices)
    return tuple(slots)


def instance_devices(config: ConfigView, gpu_count: int) -> tuple[torch.device, ...]:
    """One device per instance, in instance order."""
    return tuple(slot.device for slot in instance_slots(config, gpu_count))


def _group_gpus(model: str, group: InstanceGroup, gpu_count: int) -> Sequence[int] | None:
    """The GPUs the group's instances go to, each `count` times (None: the CPU)."""
    kind, listed, name = group.kind, group.gpus, group.name
    visible = range(gpu_count)
    if kind == "KIND_AUTO":
        usable = gpu_count > 0 and all(gpu in visible for gpu in listed)
        return (listed or visible) if usable else None
    if kind != "KIND_GPU":
        return None
    if gpu_count == 0:
        raise ModelConfigError(
            f"instance group {name} of model {model} has kind KIND_GPU but no GPUs are available"
        )
    for gpu in listed:
        if gpu not in visible:
            raise ModelConfigError(
                f"instance group {name} of model {model} specifies invalid or unsupported gpu "
                f"id {gpu}. GPUs with at least the minimum required CUDA compute compatibility "
                f"of {MIN_COMPUTE_CAPABILITY} are: {', '.join(str(g) for g in visible)}"
            )
    return listed or visible
