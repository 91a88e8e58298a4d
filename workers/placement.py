"""Where a model's instances run: Triton's `instance_group` placement, as a pure function of
the model's config and the number of GPUs the worker sees.

As in Triton: a GPU group's `count` is per GPU, on each of its `gpus` (all visible GPUs when it
lists none), instances taken count-major (`count: 2 gpus: [0, 1]` is GPU 0, 1, 0, 1); KIND_AUTO
is a GPU group when every GPU it lists is visible and there is one, else a CPU group; KIND_GPU
with no GPU, or listing one the worker cannot see, does not load, with Triton's reason.
KIND_CPU and KIND_MODEL (placement left to the backend) run on the CPU here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from sluice.shared.errors import ModelConfigError

CPU = torch.device("cpu")
#: Triton's TRITON_MIN_COMPUTE_CAPABILITY as its reason prints it (std::to_string(6.0)).
MIN_COMPUTE_CAPABILITY = "6.000000"


def instance_devices(config: Mapping[str, Any], gpu_count: int) -> tuple[torch.device, ...]:
    """One device per instance, in instance order, for a model config as Triton's JSON
    (`ModelSpec.config_json`, its groups' defaults filled in)."""
    devices: list[torch.device] = []
    for group in config.get("instance_group") or [{}]:
        count = int(group.get("count", 1))
        gpus = _group_gpus(config.get("name", ""), group, gpu_count)
        if gpus is None:
            devices.extend([CPU] * count)
        else:
            devices.extend(torch.device("cuda", gpu) for _ in range(count) for gpu in gpus)
    return tuple(devices)


def _group_gpus(model: str, group: Mapping[str, Any], gpu_count: int) -> Sequence[int] | None:
    """The GPUs the group's instances go to, each `count` times (None: the CPU)."""
    kind = group.get("kind", "KIND_AUTO")
    listed = [int(gpu) for gpu in group.get("gpus", [])]
    visible = range(gpu_count)
    if kind == "KIND_AUTO":
        usable = gpu_count > 0 and all(gpu in visible for gpu in listed)
        return (listed or visible) if usable else None
    if kind != "KIND_GPU":
        return None
    name = group.get("name", model)
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
