"""A model runs on the thread count its config asks for, on the instance's own thread."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from shared import keys
from shared.protocol import encode_requests
from tests.streams import collect_results, int_request, serving_python_model

CONFIG = """
name: "threads"
backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_INT64, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT64, dims: [ 1 ] } ]
parameters: { key: "INTRA_OP_THREAD_COUNT" value: { string_value: "1" } }
"""

#: answers with the OpenMP thread count that MKL would use in the calling thread.
MODEL = textwrap.dedent("""
    import ctypes
    from pathlib import Path

    import torch

    LIBGOMP = ctypes.CDLL(str(next(Path(torch.__file__).parent.glob("lib/libgomp*.so*"))))

    class Model:
        def __init__(self, context):
            pass

        def infer(self, inputs):
            return {"OUT": torch.full_like(inputs["IN"], LIBGOMP.omp_get_max_threads())}
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: any thread count is 1")
def test_the_instance_thread_uses_the_configured_intra_op_thread_count(
    tmp_path: Path, redis_url: str
) -> None:
    reply_to = keys.reply_stream("test")
    with serving_python_model(tmp_path, "threads", CONFIG, MODEL, redis_url) as client:
        client.xadd(keys.request_stream("threads"), encode_requests([int_request(0, reply_to)]))
        assert collect_results(client, reply_to, 1) == [("r0", 1)]
