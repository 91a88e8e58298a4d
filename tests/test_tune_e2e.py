"""`sluice tune` end to end on a model it has not seen: its own `sluice serve`, candidates
loaded live, a pick written as config.pbtxt, and a rerun that resumes instead of measuring
again. Kept short: two values per knob, a tiny ramp and short windows."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import torch
from click.testing import CliRunner
from sluice.shared.model_config import load_model_config

from sluice.bench.settings import Target
from sluice.cli import main
from sluice.tune.candidates import Candidate, apply
from sluice.tune.measure import load, model_config
from sluice.tune.server import own_serve

CONFIG = """
name: "tiny"
backend: "pytorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def tiny_repository(root: Path) -> Path:
    (root / "tiny" / "1").mkdir(parents=True)
    (root / "tiny" / "config.pbtxt").write_text(CONFIG)
    torch.manual_seed(0)
    traced = torch.jit.trace(torch.nn.Linear(4, 4).eval(), torch.zeros(1, 4))
    traced.save(str(root / "tiny" / "1" / "model.pt"))
    return root


ARGS = [
    *("tune", "--model", "tiny", "--p99-ms", "500", "--budget-s", "300"),
    *("--max-concurrency", "2", "--window-ms", "200", "--warmup-s", "0.1", "--max-trials", "3"),
    *("--max-batch-sizes", "4,8", "--delays-us", "0,100", "--instances", "1,2"),
    *("--price-per-hour", "1.5"),
]


def test_tune_picks_a_config_that_loads_and_a_rerun_resumes(tmp_path: Path) -> None:
    repo = tiny_repository(tmp_path / "repo")
    out = tmp_path / "out"
    args = [*ARGS, "--model-repository", str(repo), "--out-dir", str(out)]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "$/M infer" in first.output
    assert "--price-per-hour 1.5" in first.output
    measured = (out / "state.jsonl").read_bytes().splitlines()
    assert len(measured) >= 2  # the model's own config, then at least one neighbour
    (repo / "tiny" / "config.pbtxt").write_text((out / "config.pbtxt").read_text())
    spec = load_model_config(repo / "tiny")  # the pick is a config the repository serves
    pick = first.output.split("pick: ")[1].strip()
    assert pick.startswith(f"mbs {spec.max_batch_size} delay {spec.batching.max_queue_delay_us}us")

    (repo / "tiny" / "config.pbtxt").write_text(CONFIG)  # the same settings: resumed
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    assert (out / "state.jsonl").read_bytes().splitlines() == measured
    assert f"pick: {pick}" in again.output


async def _batch_sizes(target: Target, candidate: Candidate, base: dict[str, object]) -> set[int]:
    """Load the candidate live, send 6 requests at once, return the batch sizes executed."""
    from sluice.bench.http import Connection, encode_get, encode_request, get_json

    await load(target, apply(base, candidate))
    body = orjson.dumps(
        {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4}]}
    )
    path = f"/v2/models/{target.model}/infer"
    request = encode_request("POST", target.authority, path, body, {})
    conns = [await Connection(target.host, target.port).open() for _ in range(6)]
    answers = await asyncio.gather(*(c.exchange(request) for c in conns))
    assert [status for status, _ in answers] == [200] * 6
    stats_request = encode_get(target.authority, f"/v2/models/{target.model}/stats")
    _, stats = await get_json(conns[0], stats_request)
    for conn in conns:
        conn.close()
    batches = stats["model_stats"][0]["batch_stats"]
    return {int(b["batch_size"]) for b in batches}


def test_a_candidate_loaded_live_changes_how_requests_are_batched(tmp_path: Path) -> None:
    repo = tiny_repository(tmp_path / "repo")
    with own_serve(repo, "tiny", 1, tmp_path / "serve.log") as url:
        host, port = url.split(":")
        target = Target(host, int(port), "tiny")

        async def check() -> None:
            base = await model_config(target)
            # a 1 s window gathers all six requests; max_batch_size caps the batches at 2
            small = Candidate(2, 1_000_000, 1, "fixed", "none")
            assert max(await _batch_sizes(target, small, base)) == 2
            # batches of up to 8 now take all six at once (statistics add up across loads)
            large = Candidate(8, 1_000_000, 1, "fixed", "none")
            assert max(await _batch_sizes(target, large, base)) == 6

        asyncio.run(check())
