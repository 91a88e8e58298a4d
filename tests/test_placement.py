"""Where a model's instances run: Triton's instance_group placement, decided from the config
and the number of GPUs the worker sees (given here, so it runs without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sluice.shared.config_view import ConfigView
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import load_model_config
from sluice.shared.repository import scan_model
from sluice.workers.devices.placement import instance_devices, instance_slots
from sluice.workers.models.model_build import load_model

CPU = torch.device("cpu")


def cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


def config(tmp_path: Path, groups: str, name: str = "m") -> ConfigView:
    """A TorchScript model's config, its groups' defaults filled in as a worker sees it."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.pbtxt").write_text(
        f'name: "{name}" backend: "pytorch" max_batch_size: 8\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n' + groups
    )
    return load_model_config(tmp_path / name).config


def test_a_gpu_group_places_count_instances_on_each_listed_gpu(tmp_path: Path) -> None:
    cfg = config(tmp_path, "instance_group [ { kind: KIND_GPU count: 2 gpus: [ 0, 1 ] } ]")
    assert instance_devices(cfg, 2) == (cuda(0), cuda(1), cuda(0), cuda(1))
    assert instance_devices(cfg, 4) == (cuda(0), cuda(1), cuda(0), cuda(1))


def test_instances_of_one_number_share_their_name_across_gpus(tmp_path: Path) -> None:
    """Triton names a GPU group's instances `<group>_<n>`, one of each n per GPU."""
    groups = "instance_group [ { name: 'g' kind: KIND_GPU count: 2 gpus: [ 0, 1 ] } ]"
    cfg = config(tmp_path, groups)
    slots = [(s.group, s.number, s.device) for s in instance_slots(cfg, 2)]
    assert slots == [("g", 0, cuda(0)), ("g", 0, cuda(1)), ("g", 1, cuda(0)), ("g", 1, cuda(1))]


def test_a_gpu_group_listing_no_gpu_takes_every_visible_one(tmp_path: Path) -> None:
    cfg = config(tmp_path, "instance_group [ { kind: KIND_GPU count: 1 } ]")
    assert instance_devices(cfg, 3) == (cuda(0), cuda(1), cuda(2))


@pytest.mark.parametrize(
    ("groups", "gpus", "reason"),
    [
        (
            "instance_group [ { name: 'g' kind: KIND_GPU } ]",
            0,
            "instance group g of model m has kind KIND_GPU but no GPUs are available",
        ),
        (
            "instance_group [ { kind: KIND_GPU gpus: [ 0, 2 ] } ]",
            2,
            "instance group m_0 of model m specifies invalid or unsupported gpu id 2. GPUs with "
            "at least the minimum required CUDA compute compatibility of 6.000000 are: 0, 1",
        ),
    ],
    ids=["no-gpu", "gpu-not-visible"],
)
def test_kind_gpu_it_cannot_honour_does_not_load_with_tritons_reason(
    tmp_path: Path, groups: str, gpus: int, reason: str
) -> None:
    with pytest.raises(ModelConfigError) as err:
        instance_devices(config(tmp_path, groups), gpus)
    assert err.value.message == reason


def test_no_group_is_one_instance_per_gpu_or_one_on_the_cpu(tmp_path: Path) -> None:
    cfg = config(tmp_path, "")
    assert instance_devices(cfg, 0) == (CPU,)
    assert instance_devices(cfg, 2) == (cuda(0), cuda(1))


def test_kind_auto_falls_back_to_the_cpu_when_a_listed_gpu_is_missing(tmp_path: Path) -> None:
    cfg = config(tmp_path, "instance_group [ { kind: KIND_AUTO count: 2 gpus: [ 1 ] } ]")
    assert instance_devices(cfg, 2) == (cuda(1), cuda(1))
    assert instance_devices(cfg, 1) == (CPU, CPU)


def test_cpu_and_model_kinds_stay_on_the_cpu_and_groups_follow_each_other(
    tmp_path: Path,
) -> None:
    cpu = config(tmp_path, "instance_group [ { kind: KIND_CPU count: 3 } ]", "cpu")
    assert instance_devices(cpu, 2) == (CPU,) * 3
    two = config(
        tmp_path,
        "instance_group [ { kind: KIND_GPU count: 1 gpus: [ 1 ] },"
        " { kind: KIND_GPU count: 2 gpus: [ 0 ] } ]",
        "two",
    )
    assert instance_devices(two, 2) == (cuda(1), cuda(0), cuda(0))


def write_model(tmp_path: Path, groups: str) -> Path:
    config(tmp_path, groups)
    (tmp_path / "m" / "1").mkdir()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "m" / "1" / "model.pt")
    return tmp_path / "m"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_a_kind_gpu_model_on_a_worker_without_a_gpu_is_not_loaded(tmp_path: Path) -> None:
    entry = scan_model(write_model(tmp_path, "instance_group [ { kind: KIND_GPU count: 2 } ]"))
    assert entry.error is None
    with pytest.raises(ModelConfigError, match="has kind KIND_GPU but no GPUs are available"):
        load_model(entry)


def test_the_loaded_spec_counts_the_instances_placed(tmp_path: Path) -> None:
    """On a GPU a group's count is per GPU, so the worker's lanes are the instances placed."""
    entry = scan_model(write_model(tmp_path, "instance_group [ { kind: KIND_AUTO count: 2 } ]"))
    loaded, instances, device, _ = load_model(entry)
    gpus = max(torch.cuda.device_count(), 1)
    assert loaded.spec is not None and loaded.spec.instance_count == 2 * gpus
    assert len(instances[1]) == 2 * gpus
    assert device == (torch.device("cuda", 0) if torch.cuda.is_available() else CPU)
