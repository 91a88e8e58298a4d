"""A model repository of composing models and ensembles over them, for the ensemble tests."""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Iterator
from pathlib import Path

import torch
import tritonclient.http as httpclient

from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import ON_CLUSTER, Service, start_service, stop_service, wait_until
from tests.redis_cluster import EmbeddedCluster

F32 = "TYPE_FP32"


def _tensors(kind: str, names: dict[str, str]) -> str:
    items = ", ".join(f'{{ name: "{n}", data_type: {t}, dims: [ 1 ] }}' for n, t in names.items())
    return f"{kind} [ {items} ]"


def composing(root: Path, name: str, backend: str, inputs: list[str], outputs: list[str]) -> Path:
    """A model directory with its config; the caller writes its version's file."""
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}"\n{backend}\nmax_batch_size: 8\n'
        + _tensors("input", dict.fromkeys(inputs, F32))
        + "\n"
        + _tensors("output", dict.fromkeys(outputs, F32))
        + "\ndynamic_batching { max_queue_delay_microseconds: 2000 }\n"
    )
    return root / name / "1"


def python_model(root: Path, name: str, inputs: list[str], outputs: list[str], body: str) -> None:
    """A sluice `Model` whose infer computes `body` (an expression over `inputs`)."""
    version = composing(root, name, 'backend: "python"', inputs, outputs)
    code = f"""
        class Model:
            def __init__(self, context):
                pass

            def infer(self, inputs):
                {", ".join(inputs)}, = (inputs[n] for n in {inputs!r})
                if (({inputs[0]}) < -100).any():
                    raise ValueError("{name} refuses values below -100")
                return dict(zip({outputs!r}, ({body},)))
    """
    (version / "model.py").write_text(textwrap.dedent(code))


class Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def ensemble(
    root: Path,
    name: str,
    inputs: list[str],
    outputs: list[str],
    steps: list[tuple[str, dict[str, str], dict[str, str]]],
) -> None:
    (root / name / "1").mkdir(parents=True)
    text = [f'name: "{name}"', 'platform: "ensemble"', "max_batch_size: 8"]
    text += [
        _tensors("input", dict.fromkeys(inputs, F32)),
        _tensors("output", dict.fromkeys(outputs, F32)),
    ]
    text.append("ensemble_scheduling { step [")
    parts = []
    for model, input_map, output_map in steps:
        maps = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in input_map.items())
        maps += " " + " ".join(
            f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in output_map.items()
        )
        parts.append(f'  {{ model_name: "{model}" model_version: -1 {maps} }}')
    text.append(",\n".join(parts))
    text.append("] }")
    (root / name / "config.pbtxt").write_text("\n".join(text) + "\n")


def build(root: Path) -> Path:
    """inc (Python: x+1), double (TorchScript: 2x), add (Python: a+b), and the ensembles
    chain = inc -> double -> inc, dag = (inc, double) -> add, nested = chain -> double,
    failing = inc -> inc (which refuses values below -100 after the first step), and broken
    ones."""
    python_model(root, "inc", ["X"], ["Y"], "X + 1")
    python_model(root, "add", ["A", "B"], ["SUM"], "A + B")
    version = composing(root, "double", 'platform: "pytorch_libtorch"', ["INPUT__0"], ["OUTPUT__0"])
    torch.jit.script(Double()).save(str(version / "model.pt"))
    ensemble(
        root,
        "chain",
        ["IN"],
        ["OUT"],
        [
            ("inc", {"X": "IN"}, {"Y": "a"}),
            ("double", {"INPUT__0": "a"}, {"OUTPUT__0": "b"}),
            ("inc", {"X": "b"}, {"Y": "OUT"}),
        ],
    )
    ensemble(
        root,
        "dag",
        ["IN"],
        ["OUT"],
        [
            ("inc", {"X": "IN"}, {"Y": "left"}),
            ("double", {"INPUT__0": "IN"}, {"OUTPUT__0": "right"}),
            ("add", {"A": "left", "B": "right"}, {"SUM": "OUT"}),
        ],
    )
    ensemble(
        root,
        "nested",
        ["IN"],
        ["OUT", "MID"],
        [
            ("chain", {"IN": "IN"}, {"OUT": "MID"}),
            ("double", {"INPUT__0": "MID"}, {"OUTPUT__0": "OUT"}),
        ],
    )
    ensemble(
        root,
        "joined_input",
        ["IN"],
        ["OUT"],
        [
            ("double", {"INPUT__0": "IN"}, {"OUTPUT__0": "twice"}),
            ("add", {"A": "twice", "B": "IN"}, {"SUM": "OUT"}),
        ],
    )
    ensemble(
        root,
        "broken_model",
        ["IN"],
        ["OUT"],
        [("nowhere", {"X": "IN"}, {"Y": "OUT"})],
    )
    ensemble(
        root,
        "broken_tensor",
        ["IN"],
        ["OUT"],
        [("inc", {"NOPE": "IN"}, {"Y": "OUT"})],
    )
    return root


@contextlib.contextmanager
def serving(repo: Path, ready: str | None, *options: str) -> Iterator[Service]:
    """`sluice serve` on `repo` (and `options`) for the block, once the model `ready` is
    ready, on a Redis of its own (a gateway is ready once every model its Redis has seen is)."""
    with contextlib.ExitStack() as stack:
        redis_server = stack.enter_context(EmbeddedCluster() if ON_CLUSTER else EmbeddedRedis())
        args = ["--model-repository", str(repo), "--redis-url", redis_server.url, *options]
        svc = start_service(args)
        stack.callback(stop_service, svc)
        if ready is not None:
            client = httpclient.InferenceServerClient(svc.http_url)
            wait_until(lambda: client.is_model_ready(ready), f"{ready} to be ready")
        yield svc
