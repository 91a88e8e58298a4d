"""The next batch's inputs made while every instance is busy, so that one instance's copy to
the GPU overlaps its current batch's compute.

It is speculative and changes no batch. While no lane is free, the batch loop asks what its
decision would launch now; only a full batch is staged (nothing could join it later, as in
Triton, where a formed payload still grows until it executes). When a lane frees, the batch
loop decides again as it always does, and the lane uses the staged inputs only if it takes
exactly those requests; otherwise they are dropped and the batch is stacked as usual.

On a GPU the inputs are stacked into pinned buffers of their own and copied on a stream of their
own, with an event the lane's stream waits for (`Staged.used_on`). The buffers are refilled only
after the last copy from them is done.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import Request
from sluice.workers.devices.cuda_staging import CudaStaging, Staged
from sluice.workers.instances.stacked import collate

log = logging.getLogger(__name__)


class StageAhead:
    """At most one batch's inputs, made ahead for the lane that takes it."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self._staging = CudaStaging(device) if device.type == "cuda" else None
        self._staged: Staged | None = None
        self._last_copy: torch.cuda.Event | None = None
        #: batches that ran on inputs staged for them, and stagings dropped unused.
        self.used = 0
        self.dropped = 0

    def stage(self, requests: Sequence[Request]) -> None:
        """Make `requests`' inputs now, unless they are made already."""
        ids = tuple(r.id for r in requests)
        if self._staged is not None:
            if self._staged.ids == ids:
                return
            self._staged = None
            self.dropped += 1
        if self._last_copy is not None:
            self._last_copy.synchronize()  # the pinned buffers' last copy is done
        try:
            inputs = collate(self.spec, requests, self.device, self._staging)
        except Exception as exc:  # the lane stacks them again and answers with the error
            log.debug("%s: inputs not staged ahead: %s", self.spec.name, exc)
            return
        copied = None
        if self._staging is not None:
            copied = self._last_copy = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(self._staging.stream)
        self._staged = Staged(ids, inputs, copied)

    def take(self, requests: Sequence[Request]) -> Staged | None:
        """The inputs staged for exactly these requests, if any; anything else staged is dropped."""
        staged, self._staged = self._staged, None
        if staged is None:
            return None
        if staged.ids != tuple(r.id for r in requests):
            self.dropped += 1
            return None
        self.used += 1
        return staged
