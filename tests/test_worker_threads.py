"""Where a model runs: on the thread count its config asks for, on the instance's own thread
or, with nothing else to do, on the worker's event loop."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from sluice.shared import keys
from sluice.shared.protocol import Request, Result, Tensor, decode_results, encode_requests

from tests.streams import int_request, serving_python_model

CONFIG = """
name: "threads"
backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_INT64, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT64, dims: [ 1 ] } ]
parameters: { key: "INTRA_OP_THREAD_COUNT" value: { string_value: "1" } }
"""

#: answers 10 x the OpenMP thread count that MKL would use in the calling thread, plus 1 on
#: the worker's event-loop thread.
MODEL = textwrap.dedent("""
    import ctypes
    import threading
    from pathlib import Path

    import torch

    LIBGOMP = ctypes.CDLL(str(next(Path(torch.__file__).parent.glob("lib/libgomp*.so*"))))

    class Model:
        def __init__(self, context):
            pass

        def infer(self, inputs):
            on_loop = threading.current_thread() is threading.main_thread()
            threads = LIBGOMP.omp_get_max_threads()
            return {"OUT": torch.full_like(inputs["IN"], 10 * threads + int(on_loop))}
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: any thread count is 1")
def test_every_thread_a_batch_runs_on_uses_the_configured_intra_op_thread_count(
    tmp_path: Path, redis_url: str
) -> None:
    reply_to = keys.reply_stream("test")
    stream = keys.request_stream("threads")
    with serving_python_model(tmp_path, "threads", CONFIG, MODEL, redis_url) as client:
        answers = []
        for i in range(8):  # one at a time: after the first, they run on the loop's thread
            client.xadd(stream, encode_requests([int_request(i, reply_to)]))
            answers.append(first_value(next_result(client, reply_to, i)))
    assert answers[0] == 10  # the instance thread
    assert {a // 10 for a in answers} == {1}
    assert 11 in answers[1:]  # the loop's thread (see the test below on when it is used)


WHERE_CONFIG = """
name: "where"
backend: "python"
max_batch_size: 4
input [ { name: "IN", data_type: TYPE_INT64, dims: [ 1 ] } ]
output [ { name: "OUT", data_type: TYPE_INT64, dims: [ 1 ] } ]
dynamic_batching { }
"""

#: answers 1 when run on the worker's event-loop thread, 0 on an instance thread; fails on -1.
WHERE_MODEL = textwrap.dedent("""
    import threading

    import torch

    class Model:
        def __init__(self, context):
            pass

        def infer(self, inputs):
            if (inputs["IN"] < 0).any():
                raise ValueError("negative input")
            on_loop = threading.current_thread() is threading.main_thread()
            return {"OUT": torch.full_like(inputs["IN"], int(on_loop))}
""")


def test_requests_one_at_a_time_run_on_the_loop_and_a_failure_there_is_answered(
    tmp_path: Path, redis_url: str
) -> None:
    reply_to = keys.reply_stream("test")
    stream = keys.request_stream("where")
    values = [0, 0, 0, 0, 0, 0, -1, 0]
    with serving_python_model(tmp_path, "where", WHERE_CONFIG, WHERE_MODEL, redis_url) as client:
        answers = []
        for i, value in enumerate(values):
            data = np.array([[value]], dtype=np.int64).tobytes()
            inputs = [Tensor("IN", "INT64", (1, 1), data)]
            request = Request(f"r{i}", 1, time.time_ns(), reply_to, inputs)
            client.xadd(stream, encode_requests([request]))
            answers.append(next_result(client, reply_to, len(answers)))
    failed = answers[values.index(-1)]
    assert failed.error is not None and "negative input" in failed.error[1]
    ok = [a for a in answers if a is not failed]
    assert all(a.error is None for a in ok)
    # the first run is on the instance thread (how long a run takes is not known yet); then
    # each request comes after the last was answered, further apart than a run takes (a run
    # slowed past the limit by a busy machine goes to the thread again)
    assert first_value(ok[0]) == 0
    assert any(first_value(a) == 1 for a in ok[1:])


def next_result(client: redis.Redis, reply_to: str, seen: int) -> Result:
    """The result after the first `seen` ones on `reply_to` (waits for it)."""
    results: list[Result] = []
    while len(results) <= seen:
        reply = client.xread({reply_to: "0-0"}, block=60_000)
        assert reply, "the worker stopped answering"
        results = [r for _, fields in reply[0][1] for r in decode_results(fields)]
    return results[seen]


def first_value(result: Result) -> int:
    return int(np.frombuffer(result.outputs[0].data, np.int64)[0])
