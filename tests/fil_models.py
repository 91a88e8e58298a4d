"""What the FIL tests share: a model directory with the config.pbtxt Triton's FIL
documentation writes, and the path (or the saved file) of its model."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

#: the batcher waits this long for more rows, so that concurrent requests form batches
DELAY_US = 200_000


def fil_config(
    name: str, features: int, out: int, *, parameters: dict[str, str], input_name: str = "input__0"
) -> str:
    """A config.pbtxt as Triton's FIL documentation writes it."""
    params = ",\n".join(
        f'  {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        for key, value in parameters.items()
    )
    return (
        textwrap.dedent(
            f"""\
        name: "{name}"
        backend: "fil"
        max_batch_size: 32768
        input [ {{ name: "{input_name}" data_type: TYPE_FP32 dims: [ {features} ] }} ]
        output [ {{ name: "output__0" data_type: TYPE_FP32 dims: [ {out} ] }} ]
        instance_group [ {{ kind: KIND_AUTO }} ]
        dynamic_batching {{ max_queue_delay_microseconds: {DELAY_US} }}
        parameters [
        """
        )
        + f"{params}\n]\n"
    )


def write_model(repo: Path, name: str, config: str, filename: str) -> Path:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    return repo / name / "1" / filename


def model_path(
    repo: Path, name: str, dims: tuple[int, int], parameters: dict[str, str], filename: str
) -> Path:
    """Write the model's FIL config; the path its model file goes to."""
    return write_model(repo, name, fil_config(name, *dims, parameters=parameters), filename)


def save_model(
    repo: Path,
    name: str,
    dims: tuple[int, int],
    parameters: dict[str, str],
    filename: str,
    save: Callable[[str], object],
) -> None:
    """Write the model's FIL config and `save` its model file."""
    save(str(model_path(repo, name, dims, parameters, filename)))


def classifier(model_type: str, **extra: str) -> dict[str, str]:
    return {"model_type": model_type, "is_classifier": "true", **extra}
