"""A model repository serving the example charlm two ways, for benchmarks/inflight_vs_batched.py.

Both models run the same weights through the same code, examples' charlm model.py copied in
beside them as `charlm.py`: only the scheduling differs.

* `charlm_inflight`: sluice's generative contract under `sequence_batching { iterative_sequence:
  true }`: sequences join and leave the running batch between steps.
* `charlm_batched`: request-level dynamic batching, as a decoupled Triton Python model:
  `execute` prefills the batch it is given and steps until its longest sequence ends, sending
  each token as it comes and a request's final response when its own sequence ends. Finished
  rows leave the batch (a stronger baseline than stepping them as padding), none join it: the
  instance is held until the longest one ends.

Each step takes at least the models' STEP_MS parameter (sleeping out the rest, GIL released):
a stand-in for an accelerator, whose step costs about the same for 1 row as for 16, where
charlm's GRU on this CPU takes 0.1-0.2 ms and the serving path's per-token cost would dominate.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHARLM = ROOT / "examples" / "model_repository" / "charlm"
MODES = ("inflight", "batched")

#: both models' step, and the wait that makes it take at least `floor_s`.
FLOOR = """
def floored(start_s, floor_s):
    left_s = floor_s - (time.perf_counter() - start_s)
    if left_s > 0:
        time.sleep(left_s)
"""

INFLIGHT_MODEL = (
    '''"""charlm by in-flight batching, each step taking at least STEP_MS."""

import runpy
import time
from pathlib import Path

Charlm = runpy.run_path(str(Path(__file__).with_name("charlm.py")))["Model"]
'''
    + FLOOR
    + """

class Model(Charlm):
    def __init__(self, context):
        super().__init__(context)
        self.floor_s = float(context.parameters.get("STEP_MS", "0")) / 1e3

    def step(self, state):
        start_s = time.perf_counter()
        answer = super().step(state)
        floored(start_s, self.floor_s)
        return answer
"""
)

BATCHED_MODEL = (
    '''"""charlm by request-level dynamic batching: each batch generates to its longest sequence."""

import json
import runpy
import time
import types
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils

Charlm = runpy.run_path(str(Path(__file__).with_name("charlm.py")))["Model"]
'''
    + FLOOR
    + '''

class Prompt:
    """A request as charlm's prefill reads it."""

    def __init__(self, request):
        text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
        self.inputs = {"text_input": text.reshape(-1)}
        self.parameters = json.loads(request.parameters() or "{}")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        version_dir = Path(args["model_repository"]) / args["model_version"]
        context = types.SimpleNamespace(device=torch.device("cpu"), version_dir=version_dir)
        self.model = Charlm(context)
        self.floor_s = float(parameters.get("STEP_MS", "0")) / 1e3
        self.max_tokens = int(parameters.get("MAX_TOKENS", "256"))

    def execute(self, requests):
        with torch.inference_mode():
            self.generate(requests)
        return None

    def generate(self, requests):
        prompts = [Prompt(r) for r in requests]
        limits = [int(p.parameters.get("max_tokens", self.max_tokens)) for p in prompts]
        senders = [r.get_response_sender() for r in requests]
        made = [0] * len(requests)
        state = self.model.prefill(prompts)
        rows = list(range(len(requests)))
        while rows:
            start_s = time.perf_counter()
            outputs, finished = self.model.step(state)
            floored(start_s, self.floor_s)
            chars = outputs["text_output"]
            kept = []
            for at, row in enumerate(rows):
                made[row] += 1
                end = finished[at] or made[row] >= limits[row] or senders[row].is_cancelled()
                token = pb_utils.Tensor("text_output", chars[at : at + 1])
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if end else 0
                senders[row].send(pb_utils.InferenceResponse(output_tensors=[token]), flags=flags)
                if not end:
                    kept.append(at)
            if len(kept) < len(rows) and kept:
                state = self.model.keep(state, kept)
            rows = [rows[at] for at in kept]
'''
)

IO = """input [ { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
instance_group [ { count: 1, kind: KIND_CPU } ]
"""

SCHEDULING = {
    "inflight": "sequence_batching { iterative_sequence: true }",
    "batched": "dynamic_batching { }",
}


def config(mode: str, max_batch_size: int, step_ms: float, max_tokens: int) -> str:
    """The two configs differ only in their name and scheduler."""
    parameters = {"STEP_MS": step_ms, "MAX_TOKENS": max_tokens, "INTRA_OP_THREAD_COUNT": 1}
    return (
        f'name: "charlm_{mode}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
        + IO
        + SCHEDULING[mode]
        + "\n"
        + "".join(
            f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
            for k, v in parameters.items()
        )
    )


def build_repository(
    repo: Path, max_batch_size: int = 16, step_ms: float = 0.0, max_tokens: int = 512
) -> Path:
    """`repo` holding charlm_inflight and charlm_batched on the example's trained weights."""
    weights = CHARLM / "1" / "model.pt"
    if not weights.exists():
        raise SystemExit("build the example models first: python examples/build_models.py")
    for mode, source in (("inflight", INFLIGHT_MODEL), ("batched", BATCHED_MODEL)):
        version = repo / f"charlm_{mode}" / "1"
        version.mkdir(parents=True)
        shutil.copy(weights, version / "model.pt")
        shutil.copy(CHARLM / "1" / "model.py", version / "charlm.py")
        (version / "model.py").write_text(source)
        (version.parent / "config.pbtxt").write_text(
            config(mode, max_batch_size, step_ms, max_tokens)
        )
    return repo
