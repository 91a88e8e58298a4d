"""The join state on a real Redis: a joining step is issued once, to the producer that
completed it, and to that producer again if it is run again after a crash."""

from __future__ import annotations

import numpy as np
from sluice.shared import keys
from sluice.shared.ensemble import CLIENT, build_plan
from sluice.shared.ensemble_wire import Continuation, join_command, ready_steps
from sluice.shared.protocol import Request, Tensor, decode_requests, encode_requests
from sluice.shared.redis_client import sync_client

from tests.test_ensemble_plan import ADD, INC, dag


def _tensor(name: str, value: float) -> Tensor:
    return Tensor(name, "FP32", (1, 1), np.array([[value]], np.float32).tobytes())


def test_a_join_is_issued_once_and_again_only_to_its_issuer(redis_url: str) -> None:
    plan = build_plan("dag", {"dag": dag(), "inc": INC, "add": ADD})
    cont = Continuation(plan, CLIENT, "replies", None, (0, 0, 0), 30_000)
    client = sync_client(redis_url)
    assert join_command("e1", cont, CLIENT, {"IN": _tensor("IN", 1)}) is None

    def finish(step: int, tensor: str, value: float) -> list[tuple[int, dict[str, Tensor]]]:
        command = join_command("e1", cont.at(step), step, {tensor: _tensor(tensor, value)})
        assert command is not None
        return ready_steps(cont, client.execute_command(*command))

    assert finish(0, "left", 2.0) == []
    ((consumer, tensors),) = finish(1, "right", 3.0)
    assert consumer == 2
    assert {n: np.frombuffer(t.data, np.float32)[0] for n, t in tensors.items()} == {
        "left": 2.0,
        "right": 3.0,
    }
    assert [c for c, _ in finish(1, "right", 99.0)] == [2]  # re-run of the issuer: again
    again = dict(finish(1, "right", 99.0))
    assert np.frombuffer(again[2]["right"].data, np.float32)[0] == 3.0  # first write kept
    assert finish(0, "left", 2.0) == []  # re-run of the other producer: never
    assert 0 < client.pttl(keys.ensemble_state("e1")) <= 30_000
    client.close()


def test_carried_tensors_travel_after_the_inputs_and_come_back_apart() -> None:
    request = Request("r", 0, 0, "replies", [_tensor("X", 1.0)], None, {"p": 1}, ["cont"])
    request.carried = [_tensor("BIAS", 2.0)]
    fields = {name.encode(): value for name, value in encode_requests([request]).items()}
    (decoded,) = decode_requests(fields)
    assert [t.name for t in decoded.inputs] == ["X"]
    assert [t.name for t in decoded.carried] == ["BIAS"]
    assert decoded.continuation == ["cont"] and decoded.parameters == {"p": 1}
    assert np.frombuffer(decoded.carried[0].data, np.float32)[0] == 2.0
