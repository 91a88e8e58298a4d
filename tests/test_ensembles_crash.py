"""A worker SIGKILLed in the middle of ensembles: its step is taken over, every ensemble
request is answered exactly once (chains and joins)."""

from __future__ import annotations

import collections
import signal
import textwrap
from pathlib import Path

import numpy as np
import redis
from sluice.shared import keys
from sluice.shared.ensemble import CLIENT, build_plan, collect_configs
from sluice.shared.ensemble_wire import Continuation, join_command, step_request
from sluice.shared.model_config import load_model_config
from sluice.shared.protocol import Request, Result, Tensor, decode_results, encode_requests
from sluice.shared.redis_client import sync_client

from tests.conftest import wait_until
from tests.streams import (
    GATED_CONFIG,
    GATED_MODEL,
    PLUS_ONE_MODEL,
    start_worker,
    write_python_model,
)

RECOVERY = ("--claim-idle-ms", "600", "--max-deliveries", "3")
I64 = "TYPE_INT64"

ADD_MODEL = textwrap.dedent("""
    class Model:
        def __init__(self, context):
            pass

        def infer(self, inputs):
            return {"OUT": inputs["A"] + inputs["B"]}
""")


def _io(kind: str, names: list[str]) -> str:
    items = ", ".join(f'{{ name: "{n}", data_type: {I64}, dims: [ 1 ] }}' for n in names)
    return f"{kind} [ {items} ]"


def _ensemble(root: Path, name: str, steps: list[tuple[str, dict[str, str], str]]) -> None:
    (root / name / "1").mkdir(parents=True)
    parts = [
        f'{{ model_name: "{m}" model_version: -1 '
        + " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
        + f' output_map {{ key: "OUT" value: "{out}" }} }}'
        for m, inputs, out in steps
    ]
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 4\n'
        + _io("input", ["IN"])
        + "\n"
        + _io("output", ["OUT"])
        + "\nensemble_scheduling { step [ "
        + ", ".join(parts)
        + " ] }\n"
    )


def _repo(root: Path) -> Path:
    write_python_model(root, "gated", GATED_CONFIG.format(max_batch=4), GATED_MODEL)
    plus = GATED_CONFIG.format(max_batch=4).replace('"gated"', '"plus"')
    write_python_model(root, "plus", plus, PLUS_ONE_MODEL)
    add = (
        'name: "add"\nbackend: "python"\nmax_batch_size: 4\n'
        + _io("input", ["A", "B"])
        + "\n"
        + _io("output", ["OUT"])
    )
    write_python_model(root, "add", add, ADD_MODEL)
    _ensemble(
        root,
        "gchain",
        [("plus", {"IN": "IN"}, "a"), ("gated", {"IN": "a"}, "b"), ("plus", {"IN": "b"}, "OUT")],
    )
    _ensemble(
        root,
        "gjoin",
        [
            ("plus", {"IN": "IN"}, "r"),
            ("gated", {"IN": "IN"}, "l"),
            ("add", {"A": "l", "B": "r"}, "OUT"),
        ],
    )
    return root


def _send(client: redis.Redis, repo: Path, ensemble: str, rid: str, x: int, reply_to: str) -> None:
    """Play the gateway's part: the source steps, with their continuation."""
    configs = collect_configs(
        ensemble,
        lambda n: load_model_config(repo / n).config_json if (repo / n).is_dir() else None,
    )
    plan = build_plan(ensemble, configs)
    cont = Continuation(plan, CLIENT, reply_to, None, (0,) * len(plan.steps), 60_000)
    tensors = {"IN": Tensor("IN", "INT64", (1, 1), np.array([[x]], np.int64).tobytes())}
    parent = Request(rid, 0, 0, reply_to, [], None, {})
    assert join_command(rid, cont, CLIENT, tensors) is None
    for step in plan.sources():
        stream, request = step_request(parent, cont, step, tensors, 0)
        client.xadd(stream, encode_requests([request]))  # type: ignore[arg-type]


def test_a_killed_workers_steps_are_taken_over(tmp_path: Path, redis_url: str) -> None:
    repo = _repo(tmp_path)
    client = sync_client(redis_url)
    reply_to = keys.reply_stream("test")
    doomed = start_worker(repo, redis_url, *RECOVERY)
    expected = {}
    try:
        for i in range(4):
            _send(client, repo, "gchain", f"c{i}", i, reply_to)
            expected[f"c{i}"] = i + 3
            _send(client, repo, "gjoin", f"j{i}", i, reply_to)
            expected[f"j{i}"] = 2 * i + 2
        _, held = client.blpop("entered", timeout=60)
        assert int(held) >= 1
    finally:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(30)
    client.rpush("gate", *range(100))
    survivor = start_worker(repo, redis_url, *RECOVERY)
    try:
        streams = [keys.request_stream(m) for m in ("plus", "gated", "add")]

        def settled() -> bool:
            if sum(len(r.outputs) > 0 for r in _results(client, reply_to)) < len(expected):
                return False
            return all(
                client.xpending(s, keys.WORKER_GROUP)["pending"] == 0 and client.xlen(s) == 0
                for s in streams
            )

        wait_until(settled, "every ensemble to be answered and every step acked")
        results = _results(client, reply_to)
        assert all(r.error is None for r in results), [r.error for r in results]
        counts = collections.Counter(r.id for r in results)
        assert counts == collections.Counter(expected.keys()), counts
        for r in results:
            assert int(np.frombuffer(r.outputs[0].data, np.int64)[0]) == expected[r.id]
    finally:
        survivor.terminate()
        assert survivor.wait(30) == 0
        client.close()


def _results(client: redis.Redis, reply_to: str) -> list[Result]:
    entries = client.xrange(reply_to)
    return [r for _, fields in entries for r in decode_results(fields)]
