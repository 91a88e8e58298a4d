"""The ensemble plan: graph, flattening and Triton's load-time validation (no Redis)."""

from __future__ import annotations

from typing import Any

import pytest
from sluice.shared.ensemble import CLIENT, EnsembleError, Plan, build_plan


def model(
    name: str, inputs: dict[str, str], outputs: dict[str, str], mbs: int = 8
) -> dict[str, Any]:
    return {
        "name": name,
        "backend": "python",
        "max_batch_size": mbs,
        "input": [{"name": k, "data_type": v, "dims": [1]} for k, v in inputs.items()],
        "output": [{"name": k, "data_type": v, "dims": [1]} for k, v in outputs.items()],
    }


def ensemble(
    name: str, inputs: list[str], outputs: list[str], steps: list[Any], mbs: int = 8
) -> dict[str, Any]:
    return {
        "name": name,
        "platform": "ensemble",
        "backend": "",
        "max_batch_size": mbs,
        "input": [{"name": n, "data_type": "TYPE_FP32", "dims": [1]} for n in inputs],
        "output": [{"name": n, "data_type": "TYPE_FP32", "dims": [1]} for n in outputs],
        "ensemble_scheduling": {
            "step": [
                {"model_name": m, "model_version": -1, "input_map": i, "output_map": o}
                for m, i, o in steps
            ]
        },
    }


F = "TYPE_FP32"
INC = model("inc", {"X": F}, {"Y": F})
ADD = model("add", {"A": F, "B": F}, {"SUM": F})


def chain() -> dict[str, Any]:
    return ensemble(
        "chain",
        ["IN"],
        ["OUT"],
        [("inc", {"X": "IN"}, {"Y": "mid"}), ("inc", {"X": "mid"}, {"Y": "OUT"})],
    )


def dag() -> dict[str, Any]:
    return ensemble(
        "dag",
        ["IN"],
        ["OUT"],
        [
            ("inc", {"X": "IN"}, {"Y": "left"}),
            ("inc", {"X": "IN"}, {"Y": "right"}),
            ("add", {"A": "left", "B": "right"}, {"SUM": "OUT"}),
        ],
    )


def test_chain_has_one_source_and_no_join() -> None:
    plan = build_plan("chain", {"chain": chain(), "inc": INC})
    assert plan.sources() == [0]
    assert plan.consumers(0) == [1] and plan.consumers(1) == [plan.final]
    assert not any(plan.joins(i) for i in range(plan.final + 1))
    assert plan.producer("IN") == CLIENT


def test_dag_joins_its_two_branches() -> None:
    plan = build_plan("dag", {"dag": dag(), "inc": INC, "add": ADD})
    assert plan.sources() == [0, 1]
    assert plan.joins(2) and not plan.joins(plan.final)
    assert plan.producers(2) == {0, 1}


def test_nested_ensemble_is_flattened() -> None:
    outer = ensemble(
        "outer",
        ["A"],
        ["Z"],
        [("chain", {"IN": "A"}, {"OUT": "b"}), ("inc", {"X": "b"}, {"Y": "Z"})],
    )
    plan = build_plan("outer", {"outer": outer, "chain": chain(), "inc": INC})
    assert [s.model for s in plan.steps] == ["inc", "inc", "inc"]
    assert plan.steps[0].inputs == {"X": "A"}
    assert plan.steps[0].outputs == {"Y": "0.chain/mid"}
    assert plan.steps[1].outputs == {"Y": "b"}
    assert Plan.from_compact(plan.compact()) == plan


def test_requested_outputs_decide_what_the_answer_waits_for() -> None:
    two = ensemble(
        "two",
        ["IN"],
        ["P", "Q"],
        [("inc", {"X": "IN"}, {"Y": "P"}), ("inc", {"X": "IN"}, {"Y": "Q"})],
    )
    plan = build_plan("two", {"two": two, "inc": INC})
    assert plan.joins(plan.final)
    assert not plan.joins(plan.final, ["Q"])
    assert plan.producers(plan.final, ["Q"]) == {1}


def broken(
    steps: list[Any], inputs: list[str] | None = None, outputs: list[str] | None = None
) -> str:
    config = ensemble("bad", inputs or ["IN"], outputs or ["OUT"], steps)
    with pytest.raises(EnsembleError) as info:
        build_plan(
            "bad",
            {"bad": config, "inc": INC, "add": ADD, "small": model("small", {"X": F}, {"Y": F}, 2)},
        )
    return info.value.message


def test_triton_validation_messages() -> None:
    assert broken([("nope", {"X": "IN"}, {"Y": "OUT"})]) == (
        "ensemble bad contains models that are not available or ambiguous: nope"
    )
    assert "can appear in an output map only once" in broken(
        [("inc", {"X": "IN"}, {"Y": "OUT"}), ("inc", {"X": "IN"}, {"Y": "OUT"})]
    )
    assert broken([("inc", {"X": "IN"}, {"Y": "OUT"})], inputs=["IN", "EXTRA"]) == (
        "ensemble input 'EXTRA' for ensemble 'bad' is not used"
    )
    assert (
        broken([("inc", {"X": "IN"}, {"Y": "mid"})])
        == "output 'OUT' for ensemble 'bad' is not written"
    )
    assert "is mapping to non-existing input NOPE in model inc" in broken(
        [("inc", {"NOPE": "IN"}, {"Y": "OUT"})]
    )
    assert "is mapped from non-existing output NOPE in model inc" in broken(
        [("inc", {"X": "IN"}, {"NOPE": "OUT"})]
    )
    assert "input B in model add is not mapped to any ensemble tensors" in broken(
        [("add", {"A": "IN"}, {"SUM": "OUT"})]
    )
    assert broken([("small", {"X": "IN"}, {"Y": "OUT"})]) == (
        "ensemble bad allows maximum batch size 8, but it contains model small which only "
        "allows maximum batch size to be 2"
    )
    assert "has a cycle" in broken(
        [
            ("add", {"A": "IN", "B": "loop"}, {"SUM": "mid"}),
            ("inc", {"X": "mid"}, {"Y": "loop"}),
            ("inc", {"X": "mid"}, {"Y": "OUT"}),
        ]
    )
    assert "is unused in ensemble 'bad'" in broken(
        [("inc", {"X": "IN"}, {"Y": "OUT"}), ("inc", {"X": "IN"}, {"Y": "spare"})]
    )


def test_inconsistent_data_type() -> None:
    ints = model("ints", {"X": "TYPE_INT32"}, {"Y": "TYPE_INT32"})
    config = ensemble("bad", ["IN"], ["OUT"], [("ints", {"X": "IN"}, {"Y": "OUT"})])
    with pytest.raises(EnsembleError, match="inconsistent data type: TYPE_INT32 is inferred"):
        build_plan("bad", {"bad": config, "ints": ints})


def test_ensembles_that_contain_each_other() -> None:
    a = ensemble("a", ["IN"], ["OUT"], [("b", {"IN": "IN"}, {"OUT": "OUT"})])
    b = ensemble("b", ["IN"], ["OUT"], [("a", {"IN": "IN"}, {"OUT": "OUT"})])
    with pytest.raises(EnsembleError, match="circular dependency between ensembles: a -> b -> a"):
        build_plan("a", {"a": a, "b": b})


def test_missing_parts_of_a_step() -> None:
    config = ensemble("bad", ["IN"], ["OUT"], [("inc", {}, {"Y": "OUT"})])
    with pytest.raises(EnsembleError, match="must specify 'input_map' in step 0 of ensemble 'bad'"):
        build_plan("bad", {"bad": config, "inc": INC})
    config = ensemble("bad", ["IN"], ["OUT"], [])
    with pytest.raises(EnsembleError, match="must specify 'step' for ensemble 'bad'"):
        build_plan("bad", {"bad": config})


def test_client_inputs_ride_along_a_chain_instead_of_a_join() -> None:
    config = ensemble(
        "late",
        ["IN", "BIAS"],
        ["OUT"],
        [("inc", {"X": "IN"}, {"Y": "mid"}), ("add", {"A": "mid", "B": "BIAS"}, {"SUM": "OUT"})],
    )
    plan = build_plan("late", {"late": config, "inc": INC, "add": ADD})
    assert not plan.joins(1)
    assert plan.carried(0) == ("BIAS",)
    assert plan.carried(1) == ()
