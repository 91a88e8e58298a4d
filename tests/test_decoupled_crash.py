"""A worker SIGKILLed in the middle of a decoupled model's stream: another worker takes the
request over and runs it again from its start; the client sees every response exactly once,
in order (the gateway skips the ones the new run sends again)."""

from __future__ import annotations

import queue
import signal
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from sluice.shared import keys
from sluice.shared.redis_client import sync_client

from tests.conftest import start_sluice, stop_service, wait_until
from tests.streams import start_worker, write_python_model

RECOVERY = ("--claim-idle-ms", "600")

CONFIG = """
name: "tokens"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "N", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "HOLD", data_type: TYPE_INT32, dims: [ 1 ] }
]
output [ { name: "TOKEN", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""

MODEL = textwrap.dedent('''
    import os

    import numpy as np
    import redis
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        """Tokens i * i for i < N; after HOLD of them it says so ("entered") and waits for
        the test to open its gate."""

        def initialize(self, args):
            self.redis = redis.Redis.from_url(os.environ["GATE_REDIS_URL"])

        def execute(self, requests):
            for request in requests:
                n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
                hold = int(pb_utils.get_input_tensor_by_name(request, "HOLD").as_numpy()[0])
                sender = request.get_response_sender()
                for i in range(n):
                    if i == hold:
                        self.redis.rpush("entered", os.getpid())
                        self.redis.blpop("gate")
                    token = pb_utils.Tensor("TOKEN", np.array([i * i], np.int32))
                    sender.send(pb_utils.InferenceResponse([token]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
''')


def _inputs(n: int, hold: int) -> list[grpcclient.InferInput]:
    tensors = []
    for name, value in (("N", n), ("HOLD", hold)):
        tensor = grpcclient.InferInput(name, [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], np.int32))
        tensors.append(tensor)
    return tensors


def test_a_stream_survives_its_worker_killed_with_no_token_twice(
    tmp_path: Path, redis_url: str
) -> None:
    repo = write_python_model(tmp_path, "tokens", CONFIG, MODEL)
    redis = sync_client(redis_url)
    doomed = start_worker(repo, redis_url, *RECOVERY)
    gateway = start_sluice("gateway", ["--redis-url", redis_url])
    survivor = None
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    try:
        wait_until(lambda: client.is_model_ready("tokens"), "the model to be served")
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("tokens", _inputs(12, 5), request_id="t")
        first = [results.get(timeout=60) for _ in range(5)]
        _, pid = redis.blpop(["entered"], timeout=60)
        assert int(pid) == doomed.pid
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(30)
        redis.rpush("gate", *range(10))
        survivor = start_worker(repo, redis_url, *RECOVERY)
        rest = [results.get(timeout=120) for _ in range(7)]
        client.stop_stream()  # every response was taken: nothing else was sent
        assert results.empty()
        answers = first + rest
        assert all(error is None for _, error in answers)
        tokens = [int(result.as_numpy("TOKEN")[0]) for result, _ in answers]
        assert tokens == [i * i for i in range(12)]
        finals = [
            r.get_response().parameters["triton_final_response"].bool_param for r, _ in answers
        ]
        assert finals == [False] * 12  # the final flag came alone
        # the request ran twice: the survivor took it over, and acknowledged it at the end
        _, again = redis.blpop(["entered"], timeout=60)
        assert int(again) == survivor.pid
        stream = keys.request_stream("tokens")
        wait_until(
            lambda: redis.xpending(stream, keys.WORKER_GROUP)["pending"] == 0,
            "the request to be acknowledged",
        )
    finally:
        client.close()
        stop_service(gateway)
        for worker in (doomed, survivor):
            if worker is not None and worker.poll() is None:
                worker.terminate()
                worker.wait(30)
        redis.close()
