"""The BLS client against a real Redis, with the test playing the target model's worker: a call
goes onto the target's stream like a gateway's request and is answered on the client's own
reply stream; what cannot be sent or is never answered comes back as an error result."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sluice.shared import keys
from sluice.shared.protocol import Result, Tensor, decode_requests, encode_results
from sluice.shared.redis_client import sync_client
from sluice.shared.registry import encode_model_record
from sluice.workers.python_backend.bls import BlsCall, BlsClient

from tests.conftest import wait_until

CONFIG: dict[str, Any] = {
    "name": "target",
    "max_batch_size": 4,
    "input": [{"name": "IN", "data_type": "TYPE_INT8", "dims": [1]}],
    "output": [{"name": "OUT", "data_type": "TYPE_INT8", "dims": [1]}],
}
IN = Tensor("IN", "INT8", (1, 1), b"\x05")


@pytest.fixture
def redis(redis_url: str) -> Iterator[Any]:
    client = sync_client(redis_url)
    yield client
    client.close()


@pytest.fixture
def bls(redis_url: str) -> Iterator[BlsClient]:
    client = BlsClient(redis_url)
    yield client
    client.close()


def _register(redis: Any, config: dict[str, Any] | None, error: str | None = None) -> None:
    redis.hset(keys.MODELS, "target", encode_model_record(config, [1, 2], error))


def _call(**changes: Any) -> BlsCall:
    return BlsCall(**{"model": "target", "version": 0, "inputs": [IN], "outputs": None, **changes})


def test_a_call_goes_through_the_targets_stream_and_back(redis: Any, bls: BlsClient) -> None:
    _register(redis, CONFIG)
    pending = bls.submit(_call(outputs=("OUT",), parameters={"custom": 1}))
    stream = keys.request_stream("target")
    wait_until(lambda: redis.xlen(stream) == 1, "the request on the target's stream")
    ((_, fields),) = redis.xrange(stream)
    (request,) = decode_requests(fields)
    assert (request.version, request.outputs, request.parameters) == (0, ("OUT",), {"custom": 1})
    assert bytes(request.inputs[0].data) == b"\x05"
    assert request.reply_to == bls.reply_stream
    out = Tensor("OUT", "INT8", (1, 1), b"\x06")
    redis.xadd(request.reply_to, encode_results([Result(request.id, [out])]))
    result = pending.result(timeout=30)
    assert result.error is None
    assert bytes(result.outputs[0].data) == b"\x06"


def test_a_priority_goes_to_its_levels_stream(redis: Any, bls: BlsClient) -> None:
    _register(redis, {**CONFIG, "dynamic_batching": {"priority_levels": 2}})
    pending = bls.submit(_call(parameters={"priority": 2}, wait_s=0.01))
    wait_until(lambda: redis.xlen(keys.request_stream("target", 2)) == 1, "the level 2 stream")
    assert pending.result(timeout=30).error == ("UNAVAILABLE", "Request timeout expired")


@pytest.mark.parametrize(
    ("record", "call", "code", "message"),
    [
        (None, _call(model="absent"), "INTERNAL", "Model 'absent' is not ready."),
        ((None, "bad config"), _call(), "INTERNAL", "Model 'target' is not ready."),
        ((CONFIG, None), _call(version=3), "INTERNAL", "Model 'target' is not ready."),
        ((CONFIG, None), _call(wait_s=0.05), "UNAVAILABLE", "Request timeout expired"),
    ],
    ids=["unknown model", "not ready", "unknown version", "never answered"],
)
def test_what_fails_comes_back_as_an_error_result(
    redis: Any, bls: BlsClient, record: Any, call: BlsCall, code: str, message: str
) -> None:
    if record is not None:
        _register(redis, *record)
    result = bls.submit(call).result(timeout=30)
    assert result.error is not None
    assert result.error[0] == code
    assert message in result.error[1]


def test_an_ordinary_call_to_a_decoupled_model_is_tritons_error(redis: Any, bls: BlsClient) -> None:
    _register(redis, {**CONFIG, "model_transaction_policy": {"decoupled": True}})
    result = bls.submit(_call()).result(timeout=30)
    assert result.error is not None
    assert result.error[1].startswith(
        "Model target - Error when running inference: Model target is using the decoupled. "
        "The current BLS request call doesn't support"
    )
    assert not redis.exists(keys.request_stream("target"))


def test_a_full_queue_refuses_the_call(redis: Any, bls: BlsClient) -> None:
    policy = {"default_queue_policy": {"max_queue_size": 1}}
    _register(redis, {**CONFIG, "dynamic_batching": policy})
    redis.hset(keys.queue_sizes("target"), "0", 1)
    result = bls.submit(_call()).result(timeout=30)
    assert result.error is not None
    assert result.error[0] == "UNAVAILABLE"
    assert "Exceeds maximum queue size" in result.error[1]


def test_closing_cancels_the_calls_still_waiting(redis: Any, redis_url: str) -> None:
    _register(redis, CONFIG)
    client = BlsClient(redis_url)
    pending = client.submit(_call())
    wait_until(lambda: redis.xlen(keys.request_stream("target")) == 1, "the request")
    client.close()
    assert pending.cancelled()


def test_closing_removes_the_reply_stream(redis: Any, redis_url: str) -> None:
    _register(redis, CONFIG)
    client = BlsClient(redis_url)
    pending = client.submit(_call())
    stream = keys.request_stream("target")
    wait_until(lambda: redis.xlen(stream) == 1, "the request")
    ((_, fields),) = redis.xrange(stream)
    (request,) = decode_requests(fields)
    redis.xadd(request.reply_to, encode_results([Result(request.id)]))
    assert pending.result(timeout=30).error is None
    assert redis.exists(client.reply_stream)
    client.close()
    assert not redis.exists(client.reply_stream)


# -- decoupled calls ------------------------------------------------------------------------


def _request_on_stream(redis: Any) -> Any:
    stream = keys.request_stream("target")
    wait_until(lambda: redis.xlen(stream) == 1, "the request on the target's stream")
    ((_, fields),) = redis.xrange(stream)
    (request,) = decode_requests(fields)
    return request


def _out(value: int) -> list[Tensor]:
    return [Tensor("OUT", "INT8", (1, 1), bytes([value]))]


def test_a_decoupled_call_gets_every_response_in_order(redis: Any, bls: BlsClient) -> None:
    """Responses as the target sends them, the flag-only final one included; the ones a
    worker that took the request over sends again are not repeated."""
    _register(redis, CONFIG)
    streamed = bls.submit_streamed(_call())
    request = _request_on_stream(redis)
    arriving = iter(streamed)
    redis.xadd(request.reply_to, encode_results([Result(request.id, _out(1), None, 0, False)]))
    first = next(arriving)  # before the target is done
    assert (bytes(first.outputs[0].data), first.final) == (b"\x01", False)
    assert not streamed.finished.done()
    replies = [
        Result(request.id, _out(2), None, 1, False),
        Result(request.id, _out(1), None, 0, False),  # a takeover's replay
        Result(request.id, [], None, 2, True),
    ]
    redis.xadd(request.reply_to, encode_results(replies))
    rest = list(arriving)
    assert [(bytes(r.outputs[0].data) if r.outputs else None, r.final) for r in rest] == [
        (b"\x02", False),
        (None, True),
    ]
    assert streamed.finished.done()


def test_a_decoupled_call_to_an_ordinary_model_gets_its_one_answer(
    redis: Any, bls: BlsClient
) -> None:
    _register(redis, CONFIG)
    streamed = bls.submit_streamed(_call())
    request = _request_on_stream(redis)
    redis.xadd(request.reply_to, encode_results([Result(request.id, _out(7))]))
    (only,) = list(streamed)
    assert (bytes(only.outputs[0].data), only.final) == (b"\x07", True)


def test_a_failed_decoupled_call_is_one_final_error(bls: BlsClient) -> None:
    (only,) = list(bls.submit_streamed(_call(model="absent")))
    assert only.final
    assert only.error is not None
    assert only.error[1] == (
        "Model absent - Error when running inference: Failed for execute the inference "
        "request. Model 'absent' is not ready."
    )


def test_is_ready_reads_the_targets_record(redis: Any, bls: BlsClient) -> None:
    """pb_utils.is_model_ready: served, at a version served; unknown or failed is not."""
    _register(redis, CONFIG)
    assert bls.is_ready("target", 0)
    assert bls.is_ready("target", 2)
    assert not bls.is_ready("target", 3)
    assert not bls.is_ready("absent", 0)
    redis.hset(keys.MODELS, "broken", encode_model_record(None, [], "bad config"))
    assert not bls.is_ready("broken", 0)
