"""The sequence batcher's behaviour side by side: the same requests to sluice and tritonserver.

Both serve `tests/triton_examples_repo` (its `simple_sequence`, `simple_dyna_sequence`): each
case sends the same requests to both and prints SAME, or DIFF with both answers (statuses,
outputs, error texts). Usage, with both servers started on that repository:

    python benchmarks/sequence_cases.py --sluice 8000,8001 --triton 8500,8501
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

#: how long after its last request a sequence of `simple_sequence` is certainly released (its
#: idle time is Triton's default, 1 s).
PAST_IDLE_S = 2.5


def _http(
    port: int, model: str, sid: int | str, start: bool = False, end: bool = False, value: int = 1
) -> tuple[int, Any]:
    body = {
        "inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [value]}],
        "parameters": {"sequence_id": sid, "sequence_start": start, "sequence_end": end},
    }
    request = urllib.request.Request(
        f"http://localhost:{port}/v2/models/{model}/infer", json.dumps(body).encode()
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())["outputs"][0]["data"]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


def _grpc(port: int, model: str, sid: int | str, start: bool = False) -> tuple[str, Any]:
    client = grpcclient.InferenceServerClient(f"localhost:{port}")
    tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[1]], np.int32))
    try:
        answer = client.infer(model, [tensor], sequence_id=sid, sequence_start=start)
        return "OK", answer.as_numpy("OUTPUT").tolist()
    except InferenceServerException as exc:
        return str(exc.status()), exc.message()
    finally:
        client.close()


def _idle(http: int, _: int) -> list[Any]:
    first = _http(http, "simple_sequence", 555, start=True)
    time.sleep(PAST_IDLE_S)
    return [
        first,
        _http(http, "simple_sequence", 555, value=2),
        _http(http, "simple_sequence", 555, start=True, value=9),
    ]


CASES: list[tuple[str, Callable[[int, int], Any]]] = [
    (
        "a request that starts no known sequence (HTTP)",
        lambda h, g: _http(h, "simple_sequence", 4242),
    ),
    (
        "a request that starts no known sequence (gRPC)",
        lambda h, g: _grpc(g, "simple_sequence", 4243),
    ),
    ("the same with a string id (HTTP)", lambda h, g: _http(h, "simple_sequence", "abc")),
    (
        "START, END, then a request without START",
        lambda h, g: [
            _http(h, "simple_sequence", 77, start=True),
            _http(h, "simple_sequence", 77, end=True, value=2),
            _http(h, "simple_sequence", 77, value=3),
        ],
    ),
    (
        "a START for a running sequence",
        lambda h, g: [
            _http(h, "simple_sequence", 78, start=True, value=5),
            _http(h, "simple_sequence", 78, start=True, value=6),
            _http(h, "simple_sequence", 78, end=True, value=1),
        ],
    ),
    (
        "START and END in one request (oldest, CORRID)",
        lambda h, g: _http(h, "simple_dyna_sequence", 90, start=True, end=True, value=4),
    ),
    ("a sequence idle past its idle time", _idle),
]


def _ports(text: str) -> tuple[int, int]:
    http, grpc = (int(p) for p in text.split(","))
    return http, grpc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sluice", type=_ports, default=(8000, 8001), help="HTTP,gRPC ports")
    parser.add_argument("--triton", type=_ports, default=(8500, 8501), help="HTTP,gRPC ports")
    args = parser.parse_args()
    same = 0
    for name, case in CASES:
        triton, sluice = case(*args.triton), case(*args.sluice)
        same += triton == sluice
        print(("SAME " if triton == sluice else "DIFF ") + name)
        if triton != sluice:
            print(f"  tritonserver: {triton}\n  sluice:       {sluice}")
    print(f"{same}/{len(CASES)} the same")


if __name__ == "__main__":
    main()
