"""A CUDA instance's staging: host buffers reused per batch and grown when a batch needs more,
inputs stacked into them in one copy, outputs back through the instance's stream. The buffer
policy and the stacking run on the CPU with a plain allocator; the CUDA path needs a GPU."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from sluice.shared.model_config import ModelSpec, load_model_config
from sluice.shared.protocol import Request, Tensor
from sluice.workers.devices.cuda_staging import CudaStaging, HostBuffers, stack_into
from sluice.workers.devices.stage_ahead import StageAhead
from sluice.workers.instances.model_instance import Batch
from sluice.workers.instances.stacked import StackedInstance, collate

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class CountingAllocator:
    """Plain host memory, counting the allocations asked for."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


class HostStaging(CudaStaging):
    """The staging's host side on the CPU: the device copy is a view of the staged bytes."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.buffers = HostBuffers(CountingAllocator())

    def to_device(
        self, raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        return raw.clone().view(dtype).view(shape)


def test_a_buffer_is_reused_while_batches_fit_and_doubles_when_one_does_not() -> None:
    allocate = CountingAllocator()
    buffers = HostBuffers(allocate)
    first = buffers.take("x", 100)
    assert first.numel() == 100
    assert buffers.take("x", 60).data_ptr() == first.data_ptr()
    assert buffers.take("x", 120).numel() == 120  # twice 100: 200
    assert buffers.take("x", 500).numel() == 500  # more than twice 200: the batch's own size
    assert buffers.take("y", 8).numel() == 8
    assert allocate.sizes == [100, 200, 500, 8]
    assert (buffers.capacity("x"), buffers.capacity("y"), buffers.capacity("z")) == (500, 8, 0)


def test_inputs_are_stacked_into_the_buffer_in_one_copy() -> None:
    buffers = HostBuffers(CountingAllocator())
    parts = [np.arange(6, dtype=np.float32).reshape(3, 2), np.ones((1, 2), dtype=np.float32)]
    raw, shape = stack_into(buffers, "x", parts, np.dtype(np.float32))
    assert shape == (4, 2)
    assert np.array_equal(raw.numpy().view(np.float32).reshape(shape), np.concatenate(parts))
    again, _ = stack_into(buffers, "x", parts[1:], np.dtype(np.float32))
    assert again.data_ptr() == raw.data_ptr()
    scalar, scalar_shape = stack_into(buffers, "s", [np.array(7, dtype=np.int64)], np.dtype("<i8"))
    assert scalar_shape == () and scalar.numpy().view(np.int64).tolist() == [7]


SPEC_CONFIG = """
name: "m" backend: "pytorch" max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] },
        { name: "h" data_type: TYPE_BF16 dims: [ 1 ] },
        { name: "flat" data_type: TYPE_INT32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } },
        { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


def spec(tmp_path: Path) -> ModelSpec:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text(SPEC_CONFIG)
    return load_model_config(tmp_path / "m")


def request(i: int, rows: int) -> Request:
    x = np.full((rows, 2), i, dtype=np.float32)
    h = torch.full((rows, 1), float(i), dtype=torch.bfloat16).view(torch.int16).numpy()
    flat = np.arange(rows * 4, dtype=np.int32).reshape(rows, 4) + i
    text = b"".join(len(b"ab").to_bytes(4, "little") + b"ab" for _ in range(rows))
    return Request(
        f"r{i}",
        1,
        time.time_ns(),
        "test",
        [
            Tensor("x", "FP32", (rows, 2), x.tobytes()),
            Tensor("h", "BF16", (rows, 1), h.tobytes()),
            Tensor("flat", "INT32", (rows, 4), flat.tobytes()),
            Tensor("text", "BYTES", (rows, 1), text),
        ],
    )


def test_staged_inputs_are_the_inputs_stacked_as_before(tmp_path: Path) -> None:
    """Dtypes (BF16 too), reshape and BYTES come out as the CPU path stacks them."""
    model = spec(tmp_path)
    requests = [request(1, 2), request(2, 1)]
    plain = collate(model, requests, torch.device("cpu"))
    staged = collate(model, requests, torch.device("cpu"), HostStaging())
    assert plain.keys() == staged.keys()
    for name in ("x", "h", "flat"):
        before, after = plain[name], staged[name]
        assert isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
        assert (after.dtype, after.shape) == (before.dtype, before.shape)
        assert torch.equal(after, before)
    assert np.array_equal(np.asarray(staged["text"]), np.asarray(plain["text"]))


# -- on a GPU ------------------------------------------------------------------------------


@needs_cuda
def test_a_cuda_batch_runs_on_the_instance_stream_from_pinned_buffers(tmp_path: Path) -> None:
    model = spec(tmp_path)
    device = torch.device("cuda", 0)
    staging = CudaStaging(device)
    streams: list[torch.cuda.Stream] = []

    def infer(inputs: dict[str, object]) -> dict[str, object]:
        x = inputs["x"]
        assert isinstance(x, torch.Tensor) and x.device == device
        streams.append(torch.cuda.current_stream(device))
        return {"y": x * 2}

    requests = [request(1, 2), request(2, 3)]
    instance = StackedInstance(model, infer, device)
    outputs, _ = instance.run(Batch(requests, [2, 3], staging=staging))
    assert streams == [staging.stream]
    got = [np.frombuffer(out[0].data, dtype=np.float32).reshape(out[0].shape) for out in outputs]
    assert [g.tolist() for g in got] == [[[2.0, 2.0]] * 2, [[4.0, 4.0]] * 3]
    buffer = staging.buffers.take("x", 8)
    assert buffer.is_pinned()
    instance.run(Batch(requests[:1], [2], staging=staging))
    assert staging.buffers.take("x", 8).data_ptr() == buffer.data_ptr()


@needs_cuda
def test_outputs_come_back_in_pinned_host_tensors() -> None:
    staging = CudaStaging(torch.device("cuda", 0))
    with torch.cuda.stream(staging.stream):
        device_out = torch.arange(4, device="cuda").float()
    host = staging.to_host({"y": device_out, "n": np.zeros(1)})
    y = host["y"]
    assert isinstance(y, torch.Tensor) and not y.is_cuda and y.is_pinned()
    assert y.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert isinstance(host["n"], np.ndarray)


@needs_cuda
def test_a_batch_staged_ahead_runs_after_its_copy_on_the_lane_stream(tmp_path: Path) -> None:
    """Copied on the staging stream while the lane's stream is busy with a long kernel; the
    lane's run waits for the copy's event, not for the staging stream as a whole."""
    model = spec(tmp_path)
    device = torch.device("cuda", 0)
    lane, ahead = CudaStaging(device), StageAhead(model, device)
    requests = [request(3, 2), request(4, 1)]
    with torch.cuda.stream(lane.stream):
        torch.cuda._sleep(50_000_000)  # the lane's current batch, still computing
    ahead.stage(requests)
    staged = ahead.take(requests)
    assert staged is not None and staged.copied is not None
    x = staged.inputs["x"]
    assert isinstance(x, torch.Tensor) and x.is_cuda
    instance = StackedInstance(model, lambda inputs: {"y": inputs["x"] * 2}, device)
    outputs, _ = instance.run(Batch(requests, [2, 1], staging=lane, staged=staged))
    got = [np.frombuffer(out[0].data, dtype=np.float32).tolist() for out in outputs]
    assert got == [[6.0] * 4, [8.0] * 2]
