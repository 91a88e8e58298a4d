"""What the server gives a sequence model's requests besides the client's inputs: the config's
control inputs, the implicit state, and a `direct` batch's null requests, as Triton gives them.
"""

from __future__ import annotations

import itertools

from sluice.shared.datatypes import element_count, serialize_bytes_elements
from sluice.shared.model_config import ModelSpec
from sluice.shared.protocol import Request, Tensor
from sluice.shared.sequence_controls import Flags
from sluice.workers.batching.pending import Queued
from sluice.workers.sequences.sequence_batcher import Member


class ServerInputs:
    """One sequence model's control and state inputs."""

    def __init__(self, spec: ModelSpec) -> None:
        self.controls = spec.config.sequence_controls
        self.states = spec.config.sequence_states
        self.batched = spec.max_batch_size > 0
        self._null_ids = itertools.count()

    def give(self, member: Member[Queued]) -> None:
        """The request's control inputs, and its implicit state: the initial one on START,
        else its sequence's after the last step (its state output asked for)."""
        request = member.step.item.request
        flags = Flags(member.sequence.key, start=member.step.start, end=member.step.end)
        given = [c.wire(flags, self.batched) for c in self.controls]
        if self.states:
            held = None if member.step.start else member.sequence.state
            given += held if held is not None else [s.initial(self.batched) for s in self.states]
            if request.outputs is not None:
                wanted = [
                    s.output_name for s in self.states if s.output_name not in request.outputs
                ]
                request.outputs = (*request.outputs, *wanted)
        names = {t.name for t in given}
        request.inputs = [t for t in request.inputs if t.name not in names] + given

    def null_filled(self, members: list[Member[Queued]], now_ns: int) -> list[Queued]:
        """A `direct` batch: slots 0 up to its highest ready one, in order, an empty slot below
        it holding a null request (the first request's inputs as zeros, READY, START and END
        false, CORRID 0, the initial state), whose answer is dropped."""
        batch = [m.step.item for m in members]
        slots = [m.sequence.slot.index if m.sequence.slot else 0 for m in members]
        if slots == list(range(len(slots))):
            return batch
        by_slot = dict(zip(slots, batch, strict=True))
        return [by_slot.get(i) or self._null(batch[0], now_ns) for i in range(max(slots) + 1)]

    def _null(self, model: Queued, now_ns: int) -> Queued:
        real = model.request
        names = {c.name for c in self.controls} | {s.input_name for s in self.states}
        flags = Flags(0, ready=False)
        inputs = [Tensor(t.name, t.datatype, t.shape, _zeros(t)) for t in real.inputs]
        inputs = [t for t in inputs if t.name not in names]
        inputs += [c.wire(flags, self.batched) for c in self.controls]
        inputs += [s.initial(self.batched) for s in self.states]
        null_id = f"null:{next(self._null_ids)}"
        request = Request(null_id, real.version, now_ns, "", inputs, real.outputs)
        return Queued(request, model.stream, b"", model.pending, filler=True)


def _zeros(tensor: Tensor) -> bytes:
    """`tensor`'s data with every element zero (empty, for BYTES)."""
    if tensor.datatype == "BYTES":
        return serialize_bytes_elements([b""] * element_count(tensor.shape))
    return bytes(len(tensor.data))
