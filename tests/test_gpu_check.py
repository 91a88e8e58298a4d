"""The GPU check runs where a GPU is lent only now and then, once, with minutes to spare: its
dry run on the CPU takes every step it takes there, and its verdict on the answers names a
path that answers otherwise than the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "benchmarks")]
from gpu_check import answers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_the_dry_run_measures_every_path_and_checks_every_answer(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-dry-run"]
    subprocess.run([*command, "--out", str(tmp_path)], check=True, timeout=300)
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(figures["models"]) == {"mlp", "wide"}
    for model, paths in figures["models"].items():
        assert all(rows_per_s > 0 for rows_per_s in paths.values()), (model, paths)
        assert answers(figures, model) == "right", figures["answers"]
        for level in (1, 64):
            served = figures["served"][f"{model} c={level}"]
            assert served["throughput"] > 0 and served["gpu_util"] is None, served
    assert "| mlp | right |" in (tmp_path / "gpu_check.md").read_text()


def test_the_verdict_names_each_path_that_answers_otherwise() -> None:
    figures = {
        "device": "cpu",
        "answers": {"mlp": {"worker_path": 0.0, "staged_path": 0.25}, "wide": None},
        "served": {"mlp answer": {"relative_error": 3e-7}, "wide answer": {"relative_error": 0}},
    }
    assert answers(figures, "mlp") == "WRONG: staged ahead 2.5e-01"
    assert answers(figures, "wide") == "WRONG: worker path failed, staged ahead failed"


def test_on_a_gpu_a_staged_path_that_staged_nothing_is_said_to_check_nothing() -> None:
    paths = {"worker_path": 0.0, "staged_path": 0.0}
    figures = {
        "device": "NVIDIA H200",
        "answers": {"used": {**paths, "staged_batches_used": 3}, "unused": paths},
        "served": {"used answer": {"relative_error": 0}, "unused answer": {"relative_error": 0}},
    }
    assert answers(figures, "used") == "right"
    assert answers(figures, "unused").startswith("right (staged inputs not used")
