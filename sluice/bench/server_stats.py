"""The server's side of a window, from `/v2/models/{m}/stats` read before and after it.

Triton's statistics are cumulative counters, so a window's difference gives what the server
did during it: per-request queue and compute times (ns / count) and the executed batch sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.bench.http import Connection, ProtocolError, get_json

PHASES = ("success", "queue", "compute_input", "compute_infer", "compute_output")


def _merge(a: Mapping[Any, int], b: Mapping[Any, int], sign: int) -> dict[Any, int]:
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0) + sign * value
    return {k: v for k, v in out.items() if v}


@dataclass(frozen=True, slots=True)
class ServerTotals:
    """Counters of one model (all versions summed); differences and sums stay totals."""

    counts: dict[str, int] = field(default_factory=dict)
    ns: dict[str, int] = field(default_factory=dict)
    inferences: int = 0
    executions: int = 0
    #: executed batch size -> number of executions
    batches: dict[int, int] = field(default_factory=dict)

    def _combine(self, other: ServerTotals, sign: int) -> ServerTotals:
        return ServerTotals(
            _merge(self.counts, other.counts, sign),
            _merge(self.ns, other.ns, sign),
            self.inferences + sign * other.inferences,
            self.executions + sign * other.executions,
            _merge(self.batches, other.batches, sign),
        )

    def __add__(self, other: ServerTotals) -> ServerTotals:
        return self._combine(other, 1)

    def __sub__(self, other: ServerTotals) -> ServerTotals:
        return self._combine(other, -1)


def model_totals(body: Mapping[str, Any], model: str) -> ServerTotals:
    """Sum the `model_stats` entries of `model` in a Triton statistics body."""
    total = ServerTotals()
    for entry in body.get("model_stats") or []:
        if entry.get("name") != model:
            continue
        inference = entry.get("inference_stats") or {}
        phases = {p: inference.get(p) or {} for p in PHASES}
        batches = {
            int(b["batch_size"]): int((b.get("compute_infer") or {}).get("count", 0))
            for b in entry.get("batch_stats") or []
        }
        total += ServerTotals(
            {p: int(v.get("count", 0)) for p, v in phases.items()},
            {p: int(v.get("ns", 0)) for p, v in phases.items()},
            int(entry.get("inference_count", 0)),
            int(entry.get("execution_count", 0)),
            batches,
        )
    return total


async def fetch_totals(conn: Connection, request: bytes, model: str) -> ServerTotals | None:
    """The model's counters now, or None when the server keeps no statistics."""
    try:
        status, body = await get_json(conn, request)
    except ProtocolError:
        return None
    if status != 200 or not isinstance(body, dict):
        return None
    return model_totals(body, model)


@dataclass(frozen=True, slots=True)
class ServerSplit:
    """Where a request's time went on the server, per request, in microseconds."""

    requests: int
    request_us: float
    queue_us: float
    compute_input_us: float
    compute_infer_us: float
    compute_output_us: float
    inferences: int
    executions: int
    avg_batch: float
    batch_sizes: dict[int, int]


def _per_request_us(totals: ServerTotals, phase: str) -> float:
    count = totals.counts.get(phase, 0)
    return totals.ns.get(phase, 0) / count / 1e3 if count else 0.0


def split(totals: ServerTotals) -> ServerSplit:
    return ServerSplit(
        requests=totals.counts.get("success", 0),
        request_us=_per_request_us(totals, "success"),
        queue_us=_per_request_us(totals, "queue"),
        compute_input_us=_per_request_us(totals, "compute_input"),
        compute_infer_us=_per_request_us(totals, "compute_infer"),
        compute_output_us=_per_request_us(totals, "compute_output"),
        inferences=totals.inferences,
        executions=totals.executions,
        avg_batch=totals.inferences / totals.executions if totals.executions else 0.0,
        batch_sizes=dict(sorted(totals.batches.items())),
    )
