"""Triton's trace file (`mode=triton`): a JSON array, per trace a header object and then one
object per timestamp, as tritonserver 2.51 writes it.

With `log_frequency` N, every N traces go to `<file>.<index>` (a complete array each), index
counting from 0; the rest go to `<file>` when the gateway stops. Traces are held in memory
until written, at most `MAX_HELD` of them or `MAX_HELD_BYTES` of their tensors' text (level
TENSORS): past that they go to the next `<file>.<index>` even when `log_frequency` is 0
(Triton would hold them all until it stops).

At level TENSORS a trace also holds its request's inputs (activity TENSOR_QUEUE_INPUT) and
its outputs (TENSOR_BACKEND_OUTPUT), their values comma-joined as tritonserver writes them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
from sluice.shared.infer_codec import json_values
from sluice.shared.protocol import Tensor

MAX_HELD = 10_000
MAX_HELD_BYTES = 64 << 20


class TraceFile:
    def __init__(
        self, path: str, max_held: int = MAX_HELD, max_held_bytes: int = MAX_HELD_BYTES
    ) -> None:
        self.path = path
        self.max_held = max_held
        self.max_held_bytes = max_held_bytes
        self._held: list[list[dict[str, Any]]] = []
        self._held_bytes = 0
        self._index = 0

    def add(self, trace: list[dict[str, Any]], log_frequency: int, size: int = 0) -> None:
        """Hold `trace` (`size`: its tensors' text, in bytes) until its file is written."""
        self._held.append(trace)
        self._held_bytes += size
        held = len(self._held)
        if (
            (log_frequency and held >= log_frequency)
            or held >= self.max_held
            or self._held_bytes >= self.max_held_bytes
        ):
            self._write(f"{self.path}.{self._index}")
            self._index += 1

    def close(self) -> None:
        """What is held goes to the file itself, as Triton writes it when it stops."""
        if self._held:
            self._write(self.path)

    def _write(self, path: str) -> None:
        objects = [entry for trace in self._held for entry in trace]
        self._held, self._held_bytes = [], 0
        temporary = f"{path}.partial"
        with open(temporary, "wb") as out:
            out.write(orjson.dumps(objects))
        os.replace(temporary, path)  # a reader never sees half a file


def trace_objects(
    trace_id: int,
    model: str,
    version: int,
    request_id: str,
    stamps: list[tuple[str, int]],
    tensors: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """One trace as Triton writes it: the header, then each timestamp's object, its tensors'
    after QUEUE_START."""
    header: dict[str, Any] = {"id": trace_id, "model_name": model, "model_version": version}
    if request_id:
        header["request_id"] = request_id
    objects = [header]
    for name, ns in stamps:
        objects.append({"id": trace_id, "timestamps": [{"name": name, "ns": ns}]})
        if name == "QUEUE_START":
            objects += tensors
    return objects


def tensor_objects(
    trace_id: int, activity: str, tensors: Sequence[Tensor]
) -> tuple[list[dict[str, Any]], int]:
    """Each tensor's object as Triton writes it at level TENSORS, and their text's size."""
    objects, size = [], 0
    for tensor in tensors:
        data = ",".join(_texts(tensor))
        size += len(data)
        shape = ",".join(map(str, tensor.shape))
        described = {"name": tensor.name, "data": data, "shape": shape, "dtype": tensor.datatype}
        objects.append({"id": trace_id, "activity": activity, "tensor": described})
    return objects, size


def _texts(tensor: Tensor) -> list[str]:
    """Values as tritonserver prints them (C++ streams: `%g` for floats, 1/0 for BOOL)."""
    values = json_values(tensor)
    if tensor.datatype == "BYTES":
        return list(values)
    if isinstance(values, np.ndarray) and values.dtype.kind == "f":
        return [format(v, "g") for v in values.tolist()]
    return [str(int(v)) for v in values.tolist()]
