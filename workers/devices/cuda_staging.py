"""A CUDA instance's way in and out: reused pinned host buffers, its own stream, one wait.

Per instance (lane), on a CUDA device:

- the requests' inputs are stacked straight into a pinned host buffer kept per input name
  (`HostBuffers`: grown when a batch needs more bytes, reused otherwise), the only copy on the
  host, in place of `np.concatenate` into a fresh array;
- the host-to-device copies are enqueued without waiting on the instance's own stream, and the
  model runs under that same stream, so the stream's order is what makes the model wait for its
  inputs: no event and no synchronize on the way in;
- each tensor output is copied back, without waiting, into a pinned tensor of its own, and the
  stream is synchronized once per batch. These are not reused: the answers are views into them
  until published, which may be after this lane's next batch; torch's caching host allocator
  recycles them once let go.

Overlap: each lane runs its batches on a thread of its own (`sluice.workers.instances.lanes`) and on
a stream of its own, so while one lane's batch computes, another lane's thread stacks the next batch
and enqueues its copy, which the GPU's copy engine runs beside the first stream's kernels. One
instance gets its overlap from the batch loop: while every lane computes and the next batch is
already full, its inputs are copied ahead on a stream of their own
(`sluice.workers.devices.stage_ahead`), and the lane that takes that batch waits for the copy's
event instead of copying. The pinned input buffers are safe to refill at a lane's next batch because
its last batch ended with the stream's synchronize, after its copies.

On a CPU device none of this runs (`torch.empty(pin_memory=True)` needs CUDA): the inputs are
stacked as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: bytes -> a 1-D uint8 host tensor of at least that many bytes.
Allocate = Callable[[int], torch.Tensor]


def pinned(nbytes: int) -> torch.Tensor:
    """Page-locked host memory, which the GPU copies from without a staging copy of its own."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class HostBuffers:
    """One host buffer per input name, reused by every batch that fits; a batch that does not
    fit replaces it with one twice the size (or the batch's, if larger), so a growing batch
    size reallocates a logarithmic number of times."""

    def __init__(self, allocate: Allocate) -> None:
        self._allocate = allocate
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, nbytes: int) -> torch.Tensor:
        """The first `nbytes` bytes of `name`'s buffer."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, 2 * buffer.numel() if buffer is not None else 0)
            buffer = self._buffers[name] = self._allocate(size)
        return buffer[:nbytes]

    def capacity(self, name: str) -> int:
        """The bytes `name`'s buffer holds now (0: none yet)."""
        buffer = self._buffers.get(name)
        return 0 if buffer is None else buffer.numel()


def stack_into(
    buffers: HostBuffers, name: str, parts: Sequence[np.ndarray], dtype: np.dtype
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """`parts` stacked along their first axis in `name`'s buffer, in one copy: the buffer's
    bytes as a uint8 tensor (to view as the input's dtype once on the device) and the shape."""
    if len(parts) == 1:  # also an unbatched model's input, which may have no first axis
        shape: tuple[int, ...] = parts[0].shape
    else:
        shape = (sum(part.shape[0] for part in parts), *parts[0].shape[1:])
    raw = buffers.take(name, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    out = raw.numpy().view(dtype).reshape(shape)
    if len(parts) == 1:
        np.copyto(out, parts[0])
    else:
        np.concatenate(parts, out=out)
    return raw, shape


class CudaStaging:
    """One CUDA instance's stream and pinned input buffers."""

    def __init__(self, device: torch.device, allocate: Allocate = pinned) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch's
        self.buffers = HostBuffers(allocate)

    def to_device(self, raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
        """A staged input's bytes, copied without waiting on this instance's stream."""
        with torch.cuda.stream(self.stream):
            return raw.to(self.device, non_blocking=True).view(dtype).view(shape)

    def to_host(self, outputs: dict[str, Any]) -> dict[str, Any]:
        """The model's tensor outputs copied into pinned host tensors, then one synchronize."""
        host: dict[str, Any] = {}
        with torch.cuda.stream(self.stream):
            for name, value in outputs.items():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    copy = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                    host[name] = copy.copy_(value.detach(), non_blocking=True)
                else:
                    host[name] = value
        self.stream.synchronize()
        return host


@dataclass(frozen=True, slots=True)
class Staged:
    """A batch's model inputs made before a lane took it, and the requests they were made for."""

    ids: tuple[str, ...]
    inputs: dict[str, object]
    #: recorded on the staging stream after its copies (None: the inputs are on the host).
    copied: Any = None

    def used_on(self, stream: Any) -> None:
        """Make `stream`'s work wait for the copies, and keep their device memory from being
        reused before that work is done (it was allocated on the staging stream)."""
        if self.copied is None:
            return
        stream.wait_event(self.copied)
        for value in self.inputs.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(stream)
