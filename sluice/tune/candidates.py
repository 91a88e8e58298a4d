"""A candidate config: the knobs `sluice tune` turns, read from and written into Triton's
model config JSON (what /v2/models/M/config answers and a repository load takes)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from google.protobuf import json_format, text_format
from tritonclient.grpc.model_config_pb2 import ModelConfig

from sluice.shared.batch_delay import BatchDelay
from sluice.shared.model_config import DELAY_PARAMETER

#: "none": no preferred sizes; "max": max_batch_size is the one preferred size
Preferred = Literal["none", "max"]


@dataclass(frozen=True, slots=True, order=True)
class Candidate:
    max_batch_size: int
    delay_us: int
    instances: int
    batch_delay: BatchDelay
    preferred: Preferred

    def with_value(self, axis: str, value: Any) -> Candidate:
        return dataclasses.replace(self, **{axis: value})

    def label(self) -> str:
        return (
            f"mbs {self.max_batch_size} delay {self.delay_us}us x{self.instances} "
            f"{self.batch_delay} pref {self.preferred}"
        )


def start_of(config: dict[str, Any]) -> Candidate:
    """The candidate a model's current config is (the search starts there)."""
    batching = config.get("dynamic_batching") or {}
    groups = config.get("instance_group") or [{}]
    delay = (config.get("parameters") or {}).get(DELAY_PARAMETER, {}).get("string_value")
    max_batch_size = int(config.get("max_batch_size", 0))
    preferred = [int(size) for size in batching.get("preferred_batch_size", [])]
    return Candidate(
        max_batch_size=max_batch_size,
        delay_us=int(batching.get("max_queue_delay_microseconds", 0)),
        instances=int(groups[0].get("count", 1)),
        batch_delay="adaptive" if delay == "adaptive" else "fixed",
        preferred="max" if preferred == [max_batch_size] else "none",
    )


def apply(config: dict[str, Any], candidate: Candidate) -> dict[str, Any]:
    """`config` with the candidate's knobs set; everything else (tensors, backend) kept."""
    out = copy.deepcopy(config)
    if candidate.max_batch_size:  # a model that does not batch keeps no batcher
        out["max_batch_size"] = candidate.max_batch_size
        batching = out.setdefault("dynamic_batching", {})
        batching["max_queue_delay_microseconds"] = candidate.delay_us
        if candidate.preferred == "max":
            batching["preferred_batch_size"] = [candidate.max_batch_size]
        else:
            batching.pop("preferred_batch_size", None)
    groups = out.get("instance_group") or [{"kind": "KIND_CPU"}]
    out["instance_group"] = [{**groups[0], "count": candidate.instances}, *groups[1:]]
    parameters = out.setdefault("parameters", {})
    parameters[DELAY_PARAMETER] = {"string_value": candidate.batch_delay}
    return out


def pbtxt(config: dict[str, Any]) -> str:
    """The config as config.pbtxt text, as Triton writes and reads it."""
    message = json_format.ParseDict(config, ModelConfig(), ignore_unknown_fields=True)
    return text_format.MessageToString(message)
