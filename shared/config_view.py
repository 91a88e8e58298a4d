"""A model's config as typed fields: what gateways and workers act on, read once from the JSON.

Workers publish each model's config as Triton's JSON (shared/model_config.py makes it); both
sides parse it here once, where a model record is decoded or a config loaded, and read
attributes from then on. The JSON itself stays in `json`, for what serves it back to clients
(the config endpoint, a Python model's `args['model_config']`) and for ensemble planning,
which walks the whole graph of its composing models' tensors (shared/ensemble.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.shared.ensemble import ENSEMBLE_PLATFORM, composing_models, is_ensemble
from sluice.shared.implicit_state import StateSpec, states_from_json
from sluice.shared.partitions import config_partitions
from sluice.shared.queue_policy import QueuePolicy
from sluice.shared.response_cache_rules import cache_enabled
from sluice.shared.sequence_controls import SequenceControl, controls_from_json
from sluice.shared.sequence_routing import CHECKPOINT_PARAMETER
from sluice.shared.signature import Signature
from sluice.shared.transaction_policy import is_decoupled


@dataclass(frozen=True, slots=True)
class InstanceGroup:
    """One `instance_group` entry, Triton's defaults filled in."""

    name: str
    #: KIND_AUTO, KIND_GPU, KIND_CPU or KIND_MODEL.
    kind: str
    count: int
    #: the GPUs it lists (none: every visible one).
    gpus: tuple[int, ...]

    @classmethod
    def from_json(cls, model: str, group: dict[str, Any]) -> InstanceGroup:
        return cls(
            name=str(group.get("name", model)),
            kind=str(group.get("kind", "KIND_AUTO")),
            count=int(group.get("count", 1)),
            gpus=tuple(int(gpu) for gpu in group.get("gpus", [])),
        )


@dataclass(frozen=True, slots=True)
class ConfigView:
    """The fields of a model's config that sluice reads, typed."""

    #: as the config names them ("" when absent): an ensemble has a platform and no backend.
    platform: str
    backend: str
    #: its name, max_batch_size, inputs and outputs, which requests are checked against.
    signature: Signature
    #: `dynamic_batching`'s priority levels and queue limits.
    queue_policy: QueuePolicy
    #: `dynamic_batching { preserve_ordering }`: responses leave in the requests' order.
    preserve_ordering: bool
    #: `model_transaction_policy { decoupled }`: zero or more responses per request.
    decoupled: bool
    #: `sequence_batching { iterative_sequence }`: served by in-flight batching.
    iterative_sequence: bool
    #: `sequence_batching` without `iterative_sequence`: Triton's sequence batcher schedules it,
    #: and every request names its sequence.
    sequence_batched: bool
    #: `sequence_batching { control_input }`: the tensors the server gives a sequence's requests.
    sequence_controls: tuple[SequenceControl, ...]
    #: `sequence_batching { state }`: the implicit state carried through a sequence.
    sequence_states: tuple[StateSpec, ...]
    #: the parameter SEQUENCE_STATE_CHECKPOINT is "true": each sequence's implicit state is kept
    #: in Redis after every step, so another worker goes on with it if its own dies.
    sequence_checkpoint: bool
    #: how many partitions its request streams are split into (shared/partitions.py).
    partitions: int
    #: `response_cache { enable }`: its responses are cached where the gateway has a cache.
    response_cache: bool
    #: the models an ensemble's steps name (none for any other model).
    ensemble_steps: tuple[str, ...]
    #: where its instances run (workers/devices/placement.py); one default group when it lists none.
    instance_groups: tuple[InstanceGroup, ...]
    #: the config as Triton's JSON, as served back to clients.
    json: dict[str, Any]

    @property
    def name(self) -> str:
        return self.signature.name

    @property
    def max_batch_size(self) -> int:
        return self.signature.max_batch_size

    @property
    def is_ensemble(self) -> bool:
        return self.platform == ENSEMBLE_PLATFORM

    @classmethod
    def from_json(cls, config: dict[str, Any]) -> ConfigView:
        batching = config.get("dynamic_batching") or {}
        sequencing = config.get("sequence_batching") or {}
        return cls(
            platform=str(config.get("platform", "")),
            backend=str(config.get("backend", "")),
            signature=Signature.from_config(config),
            queue_policy=QueuePolicy.from_config(config),
            preserve_ordering=bool(batching.get("preserve_ordering")),
            decoupled=is_decoupled(config),
            iterative_sequence=bool(sequencing.get("iterative_sequence", False)),
            sequence_batched="sequence_batching" in config
            and not sequencing.get("iterative_sequence", False),
            sequence_controls=controls_from_json(sequencing),
            sequence_states=states_from_json(str(config.get("name", "")), sequencing),
            sequence_checkpoint=_parameter(config, CHECKPOINT_PARAMETER).lower() == "true",
            partitions=config_partitions(config),
            response_cache=cache_enabled(config),
            ensemble_steps=tuple(composing_models(config)) if is_ensemble(config) else (),
            instance_groups=tuple(
                InstanceGroup.from_json(str(config.get("name", "")), group)
                for group in config.get("instance_group") or [{}]
            ),
            json=config,
        )


def _parameter(config: dict[str, Any], key: str) -> str:
    """A config parameter's string value ("" when absent)."""
    value = (config.get("parameters") or {}).get(key) or {}
    return str(value.get("string_value", "")) if isinstance(value, dict) else ""
