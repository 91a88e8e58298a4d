"""Triton's system shared-memory extension side by side: the same calls to sluice and tritonserver.

Both serve a repository holding `tests/triton_examples_repo/simple`; each call (registering,
status, unregistering, infers whose inputs and outputs are in shared memory, and the CUDA routes)
goes to both, and the script prints SAME, or DIFF with both answers (status and message). Usage,
with both servers started:

    python benchmarks/shared_memory_cases.py --sluice 8300,8301 --triton 8500,8501
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

BYTES = 64


def run(url: str, gurl: str) -> list[Any]:
    out = []
    hin = shm.create_shared_memory_region("in", "/side_in", 2 * BYTES)
    hout = shm.create_shared_memory_region("out", "/side_out", 2 * BYTES)
    shm.set_shared_memory_region(
        hin, [np.arange(16, dtype=np.int32).reshape(1, 16), np.ones((1, 16), np.int32)]
    )
    c = httpclient.InferenceServerClient(url)
    g = grpcclient.InferenceServerClient(gurl)

    def tr(call: Any) -> Any:
        try:
            r = call()
            return ("ok", r if not hasattr(r, "get_response") else "result")
        except InferenceServerException as e:
            return (e.status(), e.message())

    c.unregister_system_shared_memory()
    out.append(tr(lambda: c.register_system_shared_memory("in", "/side_in", 2 * BYTES)))
    out.append(tr(lambda: c.register_system_shared_memory("in", "/side_in", BYTES)))
    out.append(tr(lambda: c.register_system_shared_memory("x", "/nonexistent_zz", BYTES)))
    out.append(tr(lambda: c.register_system_shared_memory("x", "/side_in", 4 * BYTES)))
    out.append(
        tr(lambda: c.register_system_shared_memory("x", "/side_in", BYTES, offset=3 * BYTES))
    )
    out.append(tr(lambda: c.get_system_shared_memory_status("nope")))
    out.append(tr(lambda: c.get_system_shared_memory_status()))
    out.append(tr(lambda: g.register_system_shared_memory("in", "/side_in", BYTES)))
    out.append(tr(lambda: g.get_system_shared_memory_status("nope")))

    def req(off1: int = BYTES, outsize: int = BYTES, region_out: str = "out") -> Any:
        ins = [httpclient.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in range(2)]
        outs = [httpclient.InferRequestedOutput(f"OUTPUT{i}") for i in range(2)]
        ins[0].set_shared_memory("in", BYTES)
        ins[1].set_shared_memory("in", BYTES, offset=off1)
        outs[0].set_shared_memory(region_out, outsize)
        outs[1].set_shared_memory(region_out, BYTES, offset=BYTES)
        return ins, outs

    ins, outs = req()
    out.append(tr(lambda: c.infer("simple", ins, outputs=outs)))
    ins, outs = req(off1=2 * BYTES)
    out.append(tr(lambda: c.infer("simple", ins)))
    ins, outs = req(off1=3 * BYTES)
    out.append(tr(lambda: c.infer("simple", ins)))
    c.register_system_shared_memory("out", "/side_out", 2 * BYTES)
    ins, outs = req(outsize=8)
    out.append(tr(lambda: c.infer("simple", ins, outputs=outs)))
    ins, outs = req()
    r = c.infer("simple", ins, outputs=outs)
    out.append(("resp", sorted(r.get_output("OUTPUT0").keys())))
    out.append(tr(lambda: c.unregister_system_shared_memory("nope")))
    out.append(tr(lambda: c.register_cuda_shared_memory("cu", b"AAAA", 0, 8)))
    out.append(tr(lambda: c.get_cuda_shared_memory_status()))
    c.unregister_system_shared_memory()
    shm.destroy_shared_memory_region(hin)
    shm.destroy_shared_memory_region(hout)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sluice", default="8300,8301", help="HTTP,gRPC ports")
    parser.add_argument("--triton", default="8500,8501", help="HTTP,gRPC ports")
    args = parser.parse_args()
    answers = {}
    for server in ("triton", "sluice"):
        http, grpc = getattr(args, server).split(",")
        answers[server] = run(f"localhost:{http}", f"localhost:{grpc}")
    same = 0
    for index, (triton, sluice) in enumerate(
        zip(answers["triton"], answers["sluice"], strict=True)
    ):
        same += triton == sluice
        print(("SAME " if triton == sluice else "DIFF ") + str(index))
        if triton != sluice:
            print(f"  tritonserver: {triton}\n  sluice:       {sluice}")
    print(f"{same}/{len(answers['triton'])} the same")


if __name__ == "__main__":
    main()
