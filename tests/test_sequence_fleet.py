"""Sequences across a fleet: two workers behind two gateways, a worker SIGKILLed mid-sequence.

By default, as in Triton, the sequences of the dead worker are lost: their next requests get a
clear error, never a hang, while the other worker's sequences go on. With
SEQUENCE_STATE_CHECKPOINT, the surviving worker takes the dead one's sequences over from the
state they kept, and every sequence ends with the right sum.
"""

from __future__ import annotations

import json
import signal
import subprocess
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sluice.shared import keys
from sluice.shared.redis_client import sync_client

from sluice.client.direct import RedisClient
from sluice.client.errors import InvalidRequest
from tests.conftest import Service, start_sluice, stop_service, wait_until
from tests.streams import start_worker, write_python_model

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 32
sequence_batching {{
  max_sequence_idle_microseconds: 60000000
  control_input [
    {{ name: "START", control [ {{ kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ] }} ] }}
  ]
  state [
    {{
      input_name: "TOTAL_IN"
      output_name: "TOTAL_OUT"
      data_type: TYPE_INT32
      dims: [ 1 ]
      initial_state: {{ data_type: TYPE_INT32, dims: [ 1 ], zero_data: true, name: "zero" }}
    }}
  ]
}}
input [ {{ name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] }} ]
{parameters}
"""

CHECKPOINT = 'parameters [ { key: "SEQUENCE_STATE_CHECKPOINT", value: { string_value: "true" } } ]'

MODEL = textwrap.dedent('''
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        """The running sum of INPUT over a sequence, kept only in the implicit state."""

        def execute(self, requests):
            responses = []
            for request in requests:
                value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
                total = pb_utils.get_input_tensor_by_name(request, "TOTAL_IN").as_numpy() + value
                responses.append(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUTPUT", total), pb_utils.Tensor("TOTAL_OUT", total)
                ]))
            return responses
''')

#: fewer than one worker's slots (max_batch_size): each sequence is driven one step at a time,
#: so a sequence waiting in the backlog would hold the others back until one idled out.
SEQUENCES = 20
STEPS = 8
KILL_AFTER = 4


def _repo(root: Path, name: str, checkpoint: bool) -> Path:
    config = CONFIG.format(name=name, parameters=CHECKPOINT if checkpoint else "")
    return write_python_model(root, name, config, MODEL)


def _infer(gateway: Service, model: str, sequence_id: int, value: int, step: int) -> Any:
    """One step of a sequence: (status, its OUTPUT or its error, the outputs' names)."""
    body = {
        "inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [value]}],
        "parameters": {
            "sequence_id": sequence_id,
            "sequence_start": step == 0,
            "sequence_end": step == STEPS - 1,
        },
    }
    request = urllib.request.Request(
        f"http://{gateway.http_url}/v2/models/{model}/infer", json.dumps(body).encode()
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            answer = json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"], []
    outputs = {o["name"]: o["data"][0] for o in answer["outputs"]}
    return 200, outputs.get("OUTPUT"), sorted(outputs)


def _stats(gateway: Service, model: str) -> dict[str, Any]:
    url = f"http://{gateway.http_url}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=10) as reply:
        stats: dict[str, Any] = json.loads(reply.read())["model_stats"][0]
    return stats


def _inferences(gateway: Service, model: str) -> int:
    return int(_stats(gateway, model)["inference_count"])


class Fleet:
    """Two workers and two gateways on one Redis."""

    def __init__(self, repo: Path, redis_url: str, model: str) -> None:
        self.redis = sync_client(redis_url)
        self.workers: list[subprocess.Popen[bytes]] = []
        self.gateways: list[Service] = []
        self.workers = [start_worker(repo, redis_url) for _ in range(2)]
        owners = keys.sequence_owners(model)
        wait_until(lambda: self.redis.zcard(owners) == 2, "both workers to own sequences")
        self.gateways = [start_sluice("gateway", ["--redis-url", redis_url]) for _ in range(2)]

    def close(self) -> None:
        for gateway in self.gateways:
            stop_service(gateway)
        for worker in self.workers:
            if worker.poll() is None:
                worker.terminate()
                worker.wait(30)
        self.redis.close()


def _run(fleet: Fleet, model: str, stop: signal.Signals) -> dict[int, list[tuple[int, Any]]]:
    """20 sequences, taking turns step by step over the two gateways; one worker gets `stop`
    after KILL_AFTER steps. Each sequence's answers, in order."""
    answers: dict[int, list[tuple[int, Any]]] = {s: [] for s in range(1, SEQUENCES + 1)}
    for step in range(STEPS):
        if step == KILL_AFTER:
            fleet.workers[0].send_signal(stop)
            fleet.workers[0].wait(30)
        for sequence_id, got in answers.items():
            if got and got[-1][0] != 200:
                continue  # lost: nothing more to send
            gateway = fleet.gateways[(sequence_id + step) % 2]
            status, value, _ = _infer(gateway, model, sequence_id, sequence_id + step, step)
            got.append((status, value))
    return answers


def _sums(sequence_id: int) -> list[int]:
    total, sums = 0, []
    for step in range(STEPS):
        total += sequence_id + step
        sums.append(total)
    return sums


def test_a_stateful_sequence_carries_its_state_and_hides_it_from_the_client(
    tmp_path: Path, redis_url: str
) -> None:
    repo = _repo(tmp_path, "total", checkpoint=False)
    worker = start_worker(repo, redis_url)
    gateway = start_sluice("gateway", ["--redis-url", redis_url])
    try:
        redis = sync_client(redis_url)
        wait_until(lambda: redis.zcard(keys.sequence_owners("total")) == 1, "the worker")
        answers = [_infer(gateway, "total", 5, 5 + step, step) for step in range(STEPS)]
        assert [value for _, value, _ in answers] == _sums(5)
        assert {tuple(names) for _, _, names in answers} == {("OUTPUT",)}
        # the END forgot the sequence: a request without START is Triton's error
        status, error, _ = _infer(gateway, "total", 5, 1, 1)
        assert status == 400
        assert error == (
            "inference request for sequence 5 to model 'total' must specify the START flag on "
            "the first request of the sequence"
        )
        # a new START begins from the initial state again
        assert _infer(gateway, "total", 5, 3, 0)[1] == 3
        # each step counts in Triton's statistics, the last one too (written once idle)
        wait_until(lambda: _inferences(gateway, "total") == STEPS + 1, "the statistics")
    finally:
        stop_service(gateway)
        worker.terminate()
        worker.wait(30)


def _with_a_worker_killed(
    root: Path, redis_url: str, model: str, checkpoint: bool, stop: signal.Signals
) -> dict[int, list[tuple[int, Any]]]:
    fleet = Fleet(_repo(root, model, checkpoint), redis_url, model)
    try:
        return _run(fleet, model, stop)
    finally:
        fleet.close()


def test_the_sequences_of_a_killed_worker_are_lost_with_a_clear_error(
    tmp_path: Path, redis_url: str
) -> None:
    answers = _with_a_worker_killed(tmp_path, redis_url, "total", False, signal.SIGKILL)
    lost = {s for s, got in answers.items() if got[-1][0] != 200}
    assert 0 < len(lost) < SEQUENCES  # the load went to both workers
    for sequence_id, got in answers.items():
        statuses = [status for status, _ in got]
        if sequence_id in lost:
            assert statuses == [200] * KILL_AFTER + [503]
            assert got[-1][1] == (
                f"sequence {sequence_id} of model 'total' was lost: the worker that held its "
                "state stopped; start the sequence again"
            )
            assert [value for _, value in got[:KILL_AFTER]] == _sums(sequence_id)[:KILL_AFTER]
        else:
            assert got == [(200, total) for total in _sums(sequence_id)]


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM])
def test_with_checkpoints_every_sequence_of_a_stopped_worker_goes_on_elsewhere(
    tmp_path: Path, redis_url: str, stop: signal.Signals
) -> None:
    answers = _with_a_worker_killed(tmp_path, redis_url, "kept", True, stop)
    for sequence_id, got in answers.items():
        assert got == [(200, total) for total in _sums(sequence_id)], sequence_id


def test_jobs_put_on_the_models_stream_reach_their_sequences_owner(
    tmp_path: Path, redis_url: str
) -> None:
    repo = _repo(tmp_path, "total", checkpoint=False)
    workers = [start_worker(repo, redis_url) for _ in range(2)]
    client = RedisClient(redis_url)
    try:
        wait_until(lambda: client.redis.zcard(keys.sequence_owners("total")) == 2, "the workers")
        totals = []
        for step in range(STEPS):
            parameters = {"sequence_id": "job-7", "sequence_start": step == 0}
            job = client.submit(
                "total", {"INPUT": np.array([[7 + step]], np.int32)}, parameters=parameters
            )
            totals.append(int(job.result(timeout_s=60)["OUTPUT"][0][0]))
        assert totals == _sums(7)
        with pytest.raises(InvalidRequest, match="must specify the START flag"):
            client.submit(
                "total", {"INPUT": np.array([[1]], np.int32)}, parameters={"sequence_id": "other"}
            ).result(timeout_s=60)
    finally:
        client.close()
        for worker in workers:
            worker.terminate()
            worker.wait(30)


SLOTS_CONFIG = """
name: "slots"
backend: "python"
max_batch_size: 4
sequence_batching {
  control_input [
    { name: "READY", control [ { kind: CONTROL_SEQUENCE_READY, int32_false_true: [ 0, 1 ] } ] }
  ]
}
input [ { name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""

SLOTS_MODEL = textwrap.dedent('''
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        """10 x the requests of the batch, plus the request's READY."""

        def execute(self, requests):
            responses = []
            for request in requests:
                ready = pb_utils.get_input_tensor_by_name(request, "READY").as_numpy()
                answer = (10 * len(requests) + ready).astype(np.int32)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", answer)]))
            return responses
''')


def test_a_direct_batch_fills_the_empty_slots_below_its_last_with_null_requests(
    tmp_path: Path, redis_url: str
) -> None:
    repo = write_python_model(tmp_path, "slots", SLOTS_CONFIG, SLOTS_MODEL)
    worker = start_worker(repo, redis_url)
    gateway = start_sluice("gateway", ["--redis-url", redis_url])
    try:
        redis = sync_client(redis_url)
        wait_until(lambda: redis.zcard(keys.sequence_owners("slots")) == 1, "the worker")
        assert _infer(gateway, "slots", 1, 0, 0)[1] == 11  # sequence 1 takes slot 0, alone
        # sequence 2 in slot 1 runs with a null request (READY false) in slot 0, as in Triton
        assert _infer(gateway, "slots", 2, 0, 0)[1] == 21
        assert _infer(gateway, "slots", 1, 0, 1)[1] == 11
        # the null request ran in a batch of two, but is no inference of its own
        wait_until(lambda: _inferences(gateway, "slots") == 3, "the statistics")
        stats = _stats(gateway, "slots")
        assert stats["execution_count"] == 3
        sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}
        assert sizes == {1: 2, 2: 1}
    finally:
        stop_service(gateway)
        worker.terminate()
        worker.wait(30)


TORCHSCRIPT_CONFIG = """
name: "ts_total"
platform: "pytorch_libtorch"
max_batch_size: 8
sequence_batching {
  control_input [
    { name: "START", control [ { kind: CONTROL_SEQUENCE_START, int32_false_true: [ 0, 1 ] } ] }
  ]
  state [ { input_name: "TOTAL_IN", output_name: "TOTAL_OUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
}
input [ { name: "INPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
output [ { name: "OUTPUT", data_type: TYPE_INT32, dims: [ 1 ] } ]
"""


class _RunningTotal(torch.nn.Module):
    """The running total of INPUT, plus 100 on a sequence's first step (its START)."""

    def forward(
        self, INPUT: torch.Tensor, START: torch.Tensor, TOTAL_IN: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = TOTAL_IN + INPUT
        return total + 100 * START, total


def test_a_torchscript_sequence_model_gets_its_controls_and_state_as_inputs(
    tmp_path: Path, redis_url: str
) -> None:
    (tmp_path / "ts_total" / "1").mkdir(parents=True)
    (tmp_path / "ts_total" / "config.pbtxt").write_text(TORCHSCRIPT_CONFIG)
    torch.jit.script(_RunningTotal()).save(str(tmp_path / "ts_total" / "1" / "model.pt"))
    worker = start_worker(tmp_path, redis_url)
    gateway = start_sluice("gateway", ["--redis-url", redis_url])
    try:
        redis = sync_client(redis_url)
        wait_until(lambda: redis.zcard(keys.sequence_owners("ts_total")) == 1, "the worker")
        answers = [_infer(gateway, "ts_total", 3, 3 + step, step) for step in range(STEPS)]
        assert [value for _, value, _ in answers] == [_sums(3)[0] + 100, *_sums(3)[1:]]
        assert {tuple(names) for _, _, names in answers} == {("OUTPUT",)}
    finally:
        stop_service(gateway)
        worker.terminate()
        worker.wait(30)


def _gauge(gateway: Service, name: str, model: str) -> float | None:
    with urllib.request.urlopen(f"http://{gateway.metrics_url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for line in text.splitlines():
        if line.startswith(f'{name}{{model="{model}"}}'):
            return float(line.split()[-1])
    return None


def test_the_sequences_holding_slots_show_in_the_metrics(tmp_path: Path, redis_url: str) -> None:
    repo = _repo(tmp_path, "total", checkpoint=False)
    worker = start_worker(repo, redis_url)
    gateway = start_sluice("gateway", ["--redis-url", redis_url])
    try:
        redis = sync_client(redis_url)
        wait_until(lambda: redis.zcard(keys.sequence_owners("total")) == 1, "the worker")
        for sequence_id in (1, 2, 3):
            _infer(gateway, "total", sequence_id, 1, 0)
        running = "sluice_num_requests_running"
        wait_until(lambda: _gauge(gateway, running, "total") == 3, "three sequences in slots")
        _infer(gateway, "total", 2, 1, STEPS - 1)  # its END frees its slot
        wait_until(lambda: _gauge(gateway, running, "total") == 2, "two sequences in slots")
    finally:
        stop_service(gateway)
        worker.terminate()
        worker.wait(30)
