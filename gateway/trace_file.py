"""Triton's trace file (`mode=triton`): a JSON array, per trace a header object and then one
object per timestamp, as tritonserver 2.51 writes it.

With `log_frequency` N, every N traces go to `<file>.<index>` (a complete array each), index
counting from 0; the rest go to `<file>` when the gateway stops. Traces are held in memory
until written, at most `MAX_HELD` of them: past that they go to the next `<file>.<index>`
even when `log_frequency` is 0 (Triton would hold them all until it stops).
"""

from __future__ import annotations

import os
from typing import Any

import orjson

MAX_HELD = 10_000


class TraceFile:
    def __init__(self, path: str, max_held: int = MAX_HELD) -> None:
        self.path = path
        self.max_held = max_held
        self._held: list[list[dict[str, Any]]] = []
        self._index = 0

    def add(self, trace: list[dict[str, Any]], log_frequency: int) -> None:
        self._held.append(trace)
        if (log_frequency and len(self._held) >= log_frequency) or len(self._held) >= self.max_held:
            self._write(f"{self.path}.{self._index}")
            self._index += 1

    def close(self) -> None:
        """What is held goes to the file itself, as Triton writes it when it stops."""
        if self._held:
            self._write(self.path)

    def _write(self, path: str) -> None:
        objects = [entry for trace in self._held for entry in trace]
        self._held = []
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
) -> list[dict[str, Any]]:
    """One trace as Triton writes it: the header, then each timestamp's object."""
    header: dict[str, Any] = {"id": trace_id, "model_name": model, "model_version": version}
    if request_id:
        header["request_id"] = request_id
    return [header, *({"id": trace_id, "timestamps": [{"name": n, "ns": ns}]} for n, ns in stamps)]
