"""Fuzzing the gRPC request decoding of a live `sluice serve` with hypothesis.

ModelInfer and ModelStreamInfer get arbitrary and near-valid ModelInferRequest messages, and
ModelInfer raw bytes too (a generic call with identity serializers). Nothing is answered
INTERNAL or UNKNOWN (those mean a bug), only with the statuses of a refused request; bytes that
are not a message are INVALID_ARGUMENT.
Afterwards the workers are the same processes and the gateway still serves valid requests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from tests import test_fuzz_http
from tests.conftest import Service
from tests.http_fuzz_client import assert_still_serving
from tests.process_tree import alive, descendants, rss_mb
from tests.test_fuzz_http import RSS_GROWTH_MB, Baseline

#: SLUICE_FUZZ_EXAMPLES=2000 for a longer hunt; the default keeps the file under a minute.
FUZZ = settings(
    max_examples=int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
METHOD = "/inference.GRPCInferenceService/ModelInfer"
#: what a request that is refused may get; INTERNAL and UNKNOWN never.
REFUSED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
TIMEOUT_S = 30
#: the serve process's memory and processes before the fuzz, as the HTTP fuzz takes them.
baseline = test_fuzz_http.baseline

DATATYPES = ["FP32", "FP16", "BF16", "INT8", "INT32", "INT64", "UINT8", "BOOL", "BYTES", "X", ""]
MODELS = st.sampled_from(["nobatch", "named_args", "batch8", "broken", "missing", "", "../x"])
NAMES = st.sampled_from(["IN", "x", "scale", "OUT", "", "IN\x00"]) | st.text(max_size=8)
SHAPES = st.lists(st.integers(-3, 8) | st.sampled_from([2**31, 2**62, -(2**62)]), max_size=4)
PARAMETER = st.one_of(
    st.builds(pb.InferParameter, bool_param=st.booleans()),
    st.builds(pb.InferParameter, int64_param=st.integers(-(2**63), 2**63 - 1)),
    st.builds(pb.InferParameter, string_param=st.text(max_size=16)),
    st.builds(pb.InferParameter, double_param=st.floats(allow_nan=True)),
    st.builds(pb.InferParameter, uint64_param=st.integers(0, 2**64 - 1)),
)
PARAMETERS = st.dictionaries(
    st.sampled_from(["priority", "timeout", "binary_data", "sequence_id", "x", ""]),
    PARAMETER,
    max_size=3,
)


@st.composite
def infer_requests(draw: st.DrawFn) -> Any:
    """A ModelInferRequest near a valid one: inputs with any name, type, shape and data, raw
    or typed contents (or both, or neither), parameters of any kind."""
    request = pb.ModelInferRequest(
        model_name=draw(MODELS),
        model_version=draw(st.sampled_from(["", "1", "7", "-1", "x"])),
        id=draw(st.text(max_size=8)),
    )
    for key, value in draw(PARAMETERS).items():
        request.parameters[key].CopyFrom(value)
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        tensor = request.inputs.add(
            name=draw(NAMES), datatype=draw(st.sampled_from(DATATYPES)), shape=draw(SHAPES)
        )
        for key, value in draw(PARAMETERS).items():
            tensor.parameters[key].CopyFrom(value)
        if raw:
            request.raw_input_contents.append(draw(st.binary(max_size=64)))
        elif draw(st.booleans()):
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=8)))
        else:
            tensor.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=8), max_size=4)))
    if draw(st.booleans()):  # raw contents that do not match the inputs in number
        request.raw_input_contents.append(draw(st.binary(max_size=16)))
    for name in draw(st.lists(NAMES, max_size=2)):
        request.outputs.add(name=name)
    return request


@pytest.fixture(scope="module")
def channel(service: Service) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(service.grpc_url) as own:
        yield own


def status_of(call: Any) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        return code
    return grpc.StatusCode.OK


@FUZZ
@given(request=infer_requests())
def test_model_infer_messages(channel: grpc.Channel, request: Any) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    status = status_of(lambda: stub.ModelInfer(request, timeout=TIMEOUT_S))
    event(str(status))
    assert status in REFUSED | {grpc.StatusCode.OK}


@FUZZ
@given(data=st.binary(max_size=512) | infer_requests().map(lambda r: r.SerializeToString()))
def test_raw_bytes(channel: grpc.Channel, data: bytes) -> None:
    """Bytes that decode are answered as their message is; others are INVALID_ARGUMENT."""
    call = channel.unary_unary(METHOD, request_serializer=None, response_deserializer=None)
    status = status_of(lambda: call(data, timeout=TIMEOUT_S))
    event(str(status))
    assert status in REFUSED | {grpc.StatusCode.OK}


@FUZZ
@given(requests=st.lists(infer_requests(), min_size=1, max_size=4))
def test_stream_messages(channel: grpc.Channel, requests: list[Any]) -> None:
    """Each request on a stream gets one answer (errors in-band) and the stream ends OK."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    answers = list(stub.ModelStreamInfer(iter(requests), timeout=TIMEOUT_S))
    assert len(answers) == len(requests)
    for answer in answers:
        assert not answer.error_message.startswith("internal error"), answer.error_message


def test_the_fleet_still_serves(
    channel: grpc.Channel, service: Service, baseline: Baseline
) -> None:
    """Runs last in the module: the same workers, bounded memory, correct answers."""
    assert descendants(service.process.pid) == baseline.processes
    assert all(alive(pid) for pid in baseline.processes)
    assert rss_mb(service.process.pid) - baseline.rss_mb < RSS_GROWTH_MB
    assert_still_serving(service)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = pb.ModelInferRequest(model_name="nobatch")
    request.inputs.add(name="IN", datatype="FP32", shape=[2, 3])
    request.raw_input_contents.append(np.arange(6, dtype=np.float32).tobytes())
    out = stub.ModelInfer(request, timeout=TIMEOUT_S).raw_output_contents[0]
    assert np.frombuffer(out, np.float32).tolist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
