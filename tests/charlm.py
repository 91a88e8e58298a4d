"""The example charlm built for tests (a short training), and its greedy text generated in
process, the reference the served text is checked against."""

from __future__ import annotations

import asyncio
import runpy
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from sluice.shared.datatypes import serialize_bytes_elements
from sluice.shared.model_config import load_model_config
from sluice.shared.protocol import Request, Tensor
from sluice.workers.backends.python import ModelContext
from sluice.workers.generation.generation import Generation
from sluice.workers.generation.inflight import InflightScheduler, Limits

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CHARLM = EXAMPLES / "model_repository" / "charlm"


def build_charlm(repo: Path, steps: int = 40) -> Path:
    """charlm in `repo`, trained by examples/build_models.py for `steps` steps."""
    model_dir = repo / "charlm"
    shutil.copytree(CHARLM, model_dir, ignore=shutil.ignore_patterns("model.pt", "__pycache__"))
    builders = runpy.run_path(str(EXAMPLES / "build_models.py"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as build_models.py trains: far faster for so small a GRU
    try:
        builders["build_charlm"](model_dir / "1", steps=steps)
    finally:
        torch.set_num_threads(threads)
    return model_dir


def text_request(rid: str, text: str, **parameters: Any) -> Request:
    data = serialize_bytes_elements([text.encode()])
    return Request(rid, 1, 0, "", [Tensor("text_input", "BYTES", (1, 1), data)], None, parameters)


class _Texts:
    """Responses gathered as text per request."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.texts = dict.fromkeys(ids, "")

    def send_tensors(
        self, req: Request, tensors: Sequence[Tensor], error: Any = None, final: bool = False
    ) -> None:
        assert error is None, error
        (tensor,) = tensors
        self.texts[req.id] += bytes(tensor.data)[4:].decode()  # one length-prefixed element

    def is_cancelled(self, request_id: str) -> bool:
        return False

    def end(self, request: Request, error: Any) -> bool:
        raise AssertionError(error)


async def _inline(call: Any) -> Any:
    return call()


def greedy_texts(
    model_dir: Path, prompts: dict[str, str], max_sequences: int, **parameters: Any
) -> dict[str, str]:
    """Each prompt's generated text, `max_sequences` sequences running together."""
    spec = load_model_config(model_dir)
    module = runpy.run_path(str(model_dir / "1" / "model.py"))
    device = torch.device("cpu")
    context = ModelContext("charlm", 1, model_dir, model_dir / "1", device, spec.config_json, {})
    texts = _Texts(list(prompts))
    with torch.inference_mode():
        scheduler: InflightScheduler[Request] = InflightScheduler(Limits(max_sequences))
        gen = Generation(spec, module["Model"](context), scheduler, texts, run=_inline)
        for rid, prompt in prompts.items():
            gen.submit(text_request(rid, prompt, **parameters))
        while not scheduler.idle:
            asyncio.run(gen.iterate())
    return texts.texts
