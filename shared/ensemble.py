"""An ensemble's plan: its steps as a graph of tensors, validated as Triton validates it.

Built from the Triton config JSON of the ensemble and of its composing models (gateways have
them from the model records, workers from their repository), so both sides agree on one plan.
A step that is itself an ensemble is flattened into its parent: its tensors are renamed under
the step's prefix and its inputs and outputs joined to the parent's tensors. Messages follow
Triton's (core `model_config_utils.cc`, `ensemble_utils.cc`).

The plan travels in each step request's continuation (`compact` / `from_compact`), so a
worker that finishes a step knows where its outputs go without any state of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.shared.errors import ModelConfigError

ENSEMBLE_PLATFORM = "ensemble"
#: the producer of an ensemble input: the client's request, not a step.
CLIENT = -1

Configs = Mapping[str, Mapping[str, Any]]


class EnsembleError(ModelConfigError):
    """An ensemble Triton would refuse to load; the message is Triton's."""


def is_ensemble(config: Mapping[str, Any] | None) -> bool:
    return config is not None and config.get("platform") == ENSEMBLE_PLATFORM


@dataclass(frozen=True, slots=True)
class Step:
    """One composing model run: its inputs fed from ensemble tensors, outputs written to them."""

    model: str
    #: the version asked for; 0: the latest (Triton's -1).
    version: int
    #: composing model input -> ensemble tensor.
    inputs: Mapping[str, str]
    #: composing model output -> ensemble tensor.
    outputs: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Plan:
    """A flat ensemble: no step in it is an ensemble."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    steps: tuple[Step, ...]
    _producer: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._producer.update(dict.fromkeys(self.inputs, CLIENT))
        for index, step in enumerate(self.steps):
            self._producer.update(dict.fromkeys(step.outputs.values(), index))

    @property
    def final(self) -> int:
        """The index standing for the ensemble's answer, fed by its outputs."""
        return len(self.steps)

    def producer(self, tensor: str) -> int:
        return self._producer[tensor]

    def needs(self, index: int, requested: Sequence[str] | None = None) -> tuple[str, ...]:
        """The ensemble tensors that step `index` (or the answer: `final`) takes."""
        if index == self.final:
            return tuple(requested) if requested is not None else self.outputs
        return tuple(dict.fromkeys(self.steps[index].inputs.values()))

    def producers(self, index: int, requested: Sequence[str] | None = None) -> frozenset[int]:
        return frozenset(self.producer(t) for t in self.needs(index, requested))

    def consumers(self, index: int, requested: Sequence[str] | None = None) -> list[int]:
        """The steps (and the answer) that take something step `index` writes."""
        return [
            c for c in range(self.final + 1) if c != index and index in self.producers(c, requested)
        ]

    def joins(self, index: int, requested: Sequence[str] | None = None) -> bool:
        """Whether step `index` waits on more than one step (state kept in Redis); the
        client's inputs come with the step before it (`carried`)."""
        return len(self.producers(index, requested) - {CLIENT}) > 1

    def carried(self, index: int, requested: Sequence[str] | None = None) -> tuple[str, ...]:
        """The client's inputs that the steps after step `index` (and the answer) take, which
        its request carries along."""
        below: dict[str, None] = {}
        seen: set[int] = set()
        todo = self.consumers(index, requested)
        while todo:
            consumer = todo.pop()
            if consumer in seen:
                continue
            seen.add(consumer)
            for tensor in self.needs(consumer, requested):
                if self.producer(tensor) == CLIENT:
                    below[tensor] = None
            if consumer != self.final:
                todo += self.consumers(consumer, requested)
        return tuple(sorted(below))

    def sources(self) -> list[int]:
        """The steps fed by the client's request alone: the gateway sends them."""
        return [i for i in range(self.final) if self.producers(i) == {CLIENT}]

    def compact(self) -> list[Any]:
        """The plan as plain msgpack-able lists, for a continuation."""
        steps = [[s.model, s.version, dict(s.inputs), dict(s.outputs)] for s in self.steps]
        return [self.name, list(self.inputs), list(self.outputs), steps]

    @classmethod
    def from_compact(cls, data: Any) -> Plan:
        name, inputs, outputs, steps = data
        return cls(
            str(name),
            tuple(inputs),
            tuple(outputs),
            tuple(Step(str(m), int(v), dict(i), dict(o)) for m, v, i, o in steps),
        )


# -- building and validating -------------------------------------------------------------------


def build_plan(name: str, configs: Configs) -> Plan:
    """The flattened, validated plan of ensemble `name`; EnsembleError (Triton's message)."""
    return _build(name, configs, (name,))


def composing_models(config: Mapping[str, Any]) -> list[str]:
    """The models an ensemble's steps name (ensembles among them not expanded)."""
    steps = config.get("ensemble_scheduling", {}).get("step", [])
    return list(dict.fromkeys(str(s.get("model_name", "")) for s in steps if s.get("model_name")))


def collect_configs(name: str, lookup: Callable[[str], Mapping[str, Any] | None]) -> dict[str, Any]:
    """Configs of the ensemble and, transitively, every model it names that `lookup` finds."""
    found: dict[str, Any] = {}
    todo = [name]
    while todo:
        model = todo.pop()
        if model in found:
            continue
        config = lookup(model)
        if config is None:
            continue
        found[model] = config
        if is_ensemble(config):
            todo += composing_models(config)
    return found


def _build(name: str, configs: Configs, chain: tuple[str, ...]) -> Plan:
    config = configs[name]
    steps = _declared_steps(name, config)
    _check_graph(name, config, steps)
    missing = sorted({s.model for s in steps if s.model not in configs})
    if missing:
        raise EnsembleError(
            f"ensemble {name} contains models that are not available or ambiguous: "
            + ", ".join(missing)
        )
    tensors = _tensor_types(config)
    flat: list[Step] = []
    max_batch = int(config.get("max_batch_size", 0))
    for index, step in enumerate(steps):
        child = configs[step.model]
        _check_step(name, step, child, tensors)
        child_batch = int(child.get("max_batch_size", 0))
        if child_batch > 0 and child_batch < max_batch:
            raise EnsembleError(
                f"ensemble {name} allows maximum batch size {max_batch}, but it contains model "
                f"{step.model} which only allows maximum batch size to be {child_batch}"
            )
        if is_ensemble(child):
            if step.model in chain:
                cycle = " -> ".join((*chain[chain.index(step.model) :], step.model))
                raise EnsembleError(f"circular dependency between ensembles: {cycle}")
            flat += _inline(index, step, _build(step.model, configs, (*chain, step.model)))
        else:
            flat.append(step)
    _check_order(name, flat, tuple(_names(config.get("input", []))))
    return Plan(name, tuple(_names(config.get("input", []))), _names(config["output"]), tuple(flat))


def _names(items: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    return tuple(str(i["name"]) for i in items)


def _declared_steps(name: str, config: Mapping[str, Any]) -> list[Step]:
    if config.get("backend"):
        raise EnsembleError(
            f"Ensemble model '{name}' must have platform type 'ensemble' and empty backend type"
        )
    raw = config.get("ensemble_scheduling", {}).get("step", [])
    if not raw:
        raise EnsembleError(f"must specify 'step' for ensemble '{name}'")
    steps = []
    for number, step in enumerate(raw):
        for key in ("model_name", "input_map", "output_map"):
            if not step.get(key):
                raise EnsembleError(f"must specify '{key}' in step {number} of ensemble '{name}'")
        version = int(step.get("model_version", -1))
        steps.append(
            Step(
                str(step["model_name"]),
                max(version, 0),
                {str(k): str(v) for k, v in step["input_map"].items()},
                {str(k): str(v) for k, v in step["output_map"].items()},
            )
        )
    return steps


def _check_graph(name: str, config: Mapping[str, Any], steps: Sequence[Step]) -> None:
    """The config-only checks: every tensor written once, used, and every output written."""
    inputs = _names(config.get("input", []))
    outputs = _names(config.get("output", []))
    written: set[str] = set(inputs)
    for number, step in enumerate(steps):
        for tensor in step.outputs.values():
            if tensor in written:
                raise EnsembleError(
                    f"ensemble tensor '{tensor}' can appear in an output map only once for "
                    f"ensemble '{name}' step {number}"
                )
            written.add(tensor)
    _check_use(name, inputs, outputs, steps, written)


def _check_use(
    name: str,
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
    steps: Sequence[Step],
    written: set[str],
) -> None:
    consumed = {t for s in steps for t in s.inputs.values()}
    for tensor in inputs:
        if tensor not in consumed:
            raise EnsembleError(f"ensemble input '{tensor}' for ensemble '{name}' is not used")
    for tensor in outputs:
        if tensor not in written:
            raise EnsembleError(f"output '{tensor}' for ensemble '{name}' is not written")
    for number, step in enumerate(steps):
        for tensor in step.inputs.values():
            if tensor not in written:
                raise EnsembleError(
                    f"ensemble tensor '{tensor}' read by step {number} ('{step.model}') of "
                    f"ensemble '{name}' is not written: it is neither an ensemble input nor "
                    "in any step's output map"
                )
    for step in steps:
        for tensor in step.outputs.values():
            if tensor not in consumed and tensor not in outputs:
                raise EnsembleError(f"ensemble tensor '{tensor}' is unused in ensemble '{name}'")


def _tensor_types(config: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Ensemble tensor -> (data type, where it was inferred from), from the declared I/O."""
    return {
        str(i["name"]): (str(i["data_type"]), str(config["name"]))
        for i in (*config.get("input", []), *config.get("output", []))
    }


def _check_step(
    name: str, step: Step, child: Mapping[str, Any], types: dict[str, tuple[str, str]]
) -> None:
    """The step's maps against the composing model's own inputs and outputs."""
    child_inputs = {str(i["name"]): i for i in child.get("input", [])}
    child_outputs = {str(o["name"]): o for o in child.get("output", [])}
    for key, tensor in step.inputs.items():
        if key not in child_inputs:
            raise EnsembleError(
                f"in ensemble {name}, ensemble tensor {tensor} is mapping to non-existing input "
                f"{key} in model {step.model}"
            )
    for key, tensor in step.outputs.items():
        if key not in child_outputs:
            raise EnsembleError(
                f"in ensemble {name}, ensemble tensor {tensor} is mapped from non-existing "
                f"output {key} in model {step.model}"
            )
    for key, spec in child_inputs.items():
        if key not in step.inputs and not spec.get("optional", False):
            raise EnsembleError(
                f"in ensemble {name}, input {key} in model {step.model} is not mapped to any "
                "ensemble tensors"
            )
    edges = [(step.inputs, child_inputs), (step.outputs, child_outputs)]
    for mapping, specs in edges:
        for key, tensor in mapping.items():
            dtype = str(specs[key]["data_type"])
            seen = types.setdefault(tensor, (dtype, step.model))
            if seen[0] != dtype:
                raise EnsembleError(
                    f"in ensemble {name}, inconsistent data type: {dtype} is inferred from model "
                    f"{step.model} while {seen[0]} is inferred from model {seen[1]}"
                )


def _inline(index: int, step: Step, child: Plan) -> list[Step]:
    """A nested ensemble's steps in its parent: its inputs and outputs become the tensors the
    parent step maps them to, its own tensors are renamed under the step's prefix."""
    prefix = f"{index}.{child.name}/"
    rename = {t: step.inputs[t] for t in child.inputs if t in step.inputs}
    rename.update({t: step.outputs[t] for t in child.outputs if t in step.outputs})

    def parent(tensor: str) -> str:
        return rename.get(tensor, prefix + tensor)

    return [
        Step(
            s.model,
            s.version,
            {k: parent(v) for k, v in s.inputs.items()},
            {k: parent(v) for k, v in s.outputs.items()},
        )
        for s in child.steps
    ]


def _check_order(name: str, steps: Sequence[Step], inputs: tuple[str, ...]) -> None:
    """Every step can run: the steps' tensors form no cycle."""
    ready = set(inputs)
    left = list(range(len(steps)))
    while left:
        runnable = [i for i in left if set(steps[i].inputs.values()) <= ready]
        if not runnable:
            stuck = ", ".join(f"'{steps[i].model}'" for i in left)
            raise EnsembleError(
                f"ensemble '{name}' has a cycle: steps {stuck} each wait for another's output"
            )
        for i in runnable:
            ready.update(steps[i].outputs.values())
            left.remove(i)
