"""Triton's implicit state (`sequence_batching { state [...] }`): a tensor the server carries
from one request of a sequence to the next, so the client never sends it.

Each entry names the model's state input and output, their datatype and dims, and how the
state starts (`initial_state`: `zero_data`, else zeros of the state's dims). The server gives
every request of a sequence the state input: the initial state on its START, after that the
state output of its previous request. The state output is the model's, never the client's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
from sluice.shared.datatypes import NUMPY_DTYPE, config_to_wire
from sluice.shared.errors import ModelConfigError
from sluice.shared.protocol import Tensor


@dataclass(frozen=True, slots=True)
class StateSpec:
    input_name: str
    output_name: str
    #: the wire datatype.
    datatype: str
    #: the initial state's dims (a -1 of the state's own dims counts as 1).
    initial_dims: tuple[int, ...]

    def initial(self, batched: bool) -> Tensor:
        """The state a sequence starts with: zeros, shaped as a request's input."""
        shape = ((1,) if batched else ()) + self.initial_dims
        data = np.zeros(shape, NUMPY_DTYPE[self.datatype]).tobytes()
        return Tensor(self.input_name, self.datatype, shape, data)


def states_from_json(model: str, sequencing: dict[str, Any]) -> tuple[StateSpec, ...]:
    """The `state` entries of a config's `sequence_batching`, as Triton's JSON."""
    specs = []
    for entry in sequencing.get("state") or []:
        datatype = config_to_wire(str(entry.get("data_type", "TYPE_FP32")))
        if datatype == "BYTES":
            raise ModelConfigError(f"model '{model}': a BYTES implicit state is not supported")
        dims = tuple(max(1, int(d)) for d in entry.get("dims") or [])
        for initial in entry.get("initial_state") or []:
            if initial.get("data_file"):
                raise ModelConfigError(
                    f"model '{model}': implicit state '{entry.get('input_name')}' starts from "
                    "a data_file, which sluice does not read; use zero_data"
                )
            dims = tuple(int(d) for d in initial.get("dims") or dims)
        specs.append(StateSpec(str(entry["input_name"]), str(entry["output_name"]), datatype, dims))
    return tuple(specs)


def pack_states(tensors: list[Tensor]) -> bytes:
    """A sequence's state tensors as bytes, to keep them in Redis."""
    return msgpack.packb([[t.name, t.datatype, list(t.shape), bytes(t.data)] for t in tensors])


def unpack_states(packed: bytes) -> list[Tensor]:
    return [
        Tensor(name, datatype, tuple(shape), data)
        for name, datatype, shape, data in msgpack.unpackb(packed)
    ]
