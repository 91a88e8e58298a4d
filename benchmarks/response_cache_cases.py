"""Triton's response cache side by side: the same requests to sluice and tritonserver 2.51.

Both serve a repository holding a copy of `tests/triton_examples_repo/simple` named `cached`,
with `response_cache { enable: true }` and dynamic batching, and both run a local cache
(`--cache-config local,size=1048576`). The script sends each case to both (HTTP binary, gRPC,
HTTP JSON; repeats and new tensors; a request asking for one output), then compares each answer
(status and outputs), the model's statistics (success, queue, inference, execution, cache_hit,
cache_miss counts) and the nv_cache_* series names and help. It prints SAME, or DIFF with both.

    python benchmarks/response_cache_cases.py --sluice 8300,8301,8302 --triton 8500,8501,8502
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

MODEL = "cached"


def _inputs(module: Any, value: int) -> list[Any]:
    tensors = [module.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in range(2)]
    for tensor in tensors:
        tensor.set_data_from_numpy(np.full((1, 16), value, np.int32))
    return tensors


def _outputs(result: Any, names: list[str]) -> dict[str, list[int]]:
    return {name: result.as_numpy(name).ravel().tolist() for name in names}


def _json(http: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{http}/v2/models/{MODEL}/infer", json.dumps(body).encode()
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            answer = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    return 200, {o["name"]: o["data"] for o in answer["outputs"]}


def run(ports: list[int]) -> list[tuple[str, Any]]:
    http, grpc, metrics = (f"127.0.0.1:{p}" for p in ports)
    hc = httpclient.InferenceServerClient(http)
    gc = grpcclient.InferenceServerClient(grpc)
    names = ["OUTPUT0", "OUTPUT1"]
    tensor = {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [3] * 16}
    other = {**tensor, "name": "INPUT1"}
    cases: list[tuple[str, Any]] = []
    for label, value in (("new tensors", 1), ("the same again", 1), ("new", 2)):
        cases.append(
            (f"HTTP binary, {label}", _outputs(hc.infer(MODEL, _inputs(httpclient, value)), names))
        )
    cases.append(
        ("gRPC, tensors HTTP sent", _outputs(gc.infer(MODEL, _inputs(grpcclient, 2)), names))
    )
    cases.append(
        (
            "HTTP JSON, tensors binary sent",
            _json(http, {"inputs": [{**tensor, "data": [1] * 16}, {**other, "data": [1] * 16}]}),
        )
    )
    cases.append(
        (
            "HTTP JSON, new tensors, OUTPUT0 only",
            _json(http, {"inputs": [tensor, other], "outputs": [{"name": "OUTPUT0"}]}),
        )
    )
    cases.append(("HTTP JSON, the same, every output", _json(http, {"inputs": [tensor, other]})))
    stats = hc.get_inference_statistics(MODEL)["model_stats"][0]
    counts = {k: v["count"] for k, v in stats["inference_stats"].items()}
    counts |= {k: stats[k] for k in ("inference_count", "execution_count")}
    cases.append(("statistics", counts))
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    helps = sorted(line for line in text.splitlines() if line.startswith("# HELP nv_cache"))
    cases.append(("nv_cache_* families", helps))
    helps = sorted(
        line
        for line in text.splitlines()
        if line.startswith("# HELP nv_inference_") and "cached" in line
    )
    cases.append(("help texts that name cached requests", helps))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sluice", required=True, help="HTTP,gRPC,metrics ports")
    parser.add_argument("--triton", required=True, help="HTTP,gRPC,metrics ports")
    args = parser.parse_args()
    sluice = run([int(p) for p in args.sluice.split(",")])
    triton = run([int(p) for p in args.triton.split(",")])
    same = 0
    for (label, ours), (_, theirs) in zip(sluice, triton, strict=True):
        if ours == theirs:
            same += 1
            print(f"SAME  {label}")
        else:
            print(f"DIFF  {label}\n  sluice: {ours}\n  triton: {theirs}")
    print(f"\n{same}/{len(sluice)} the same")


if __name__ == "__main__":
    main()
