"""ModelInferRequest to the core's request and back, and the gRPC status of every error,
without a server: each datatype's typed contents, raw buffers, and every refusal."""

from __future__ import annotations

import struct
from typing import Any

import grpc
import numpy as np
import pytest
import redis
from sluice.gateway.grpc_app import grpc_status
from sluice.gateway.grpc_codec import CONTENTS_FIELD, GrpcInfer, infer_response
from sluice.gateway.infer_results import InferOutcome
from sluice.shared import errors
from sluice.shared.datatypes import NUMPY_DTYPE, serialize_bytes_elements
from sluice.shared.infer_codec import ParsedInfer
from sluice.shared.protocol import Tensor
from sluice.shared.signature import Signature
from tritonclient.grpc import service_pb2 as pb


def _signature(datatype: str, dims: list[int], max_batch_size: int = 8) -> Signature:
    config = {
        "name": "m",
        "max_batch_size": max_batch_size,
        "input": [{"name": "IN", "data_type": f"TYPE_{datatype}", "dims": dims}],
        "output": [{"name": "OUT", "data_type": f"TYPE_{datatype}", "dims": dims}],
    }
    return Signature.from_config(config)


def _decode(request: Any, datatype: str = "FP32", dims: list[int] | None = None) -> ParsedInfer:
    return GrpcInfer(request).decode(b"", _signature(datatype, dims or [2]))


def _typed(datatype: str, values: list[Any], shape: list[int]) -> Any:
    tensor = pb.ModelInferRequest.InferInputTensor(name="IN", datatype=datatype, shape=shape)
    getattr(tensor.contents, CONTENTS_FIELD[datatype]).extend(values)
    return pb.ModelInferRequest(model_name="m", inputs=[tensor])


TYPED_VALUES = {
    "BOOL": [True, False],
    "INT8": [-128, 127],
    "INT16": [-(2**15), 2**15 - 1],
    "INT32": [-(2**31), 2**31 - 1],
    "INT64": [-(2**63), 2**63 - 1],
    "UINT8": [0, 255],
    "UINT16": [0, 65535],
    "UINT32": [0, 2**32 - 1],
    "UINT64": [0, 2**64 - 1],
    "FP32": [1.5, -2.25],
    "FP64": [1.5, -2.25],
}


@pytest.mark.parametrize("datatype", sorted(TYPED_VALUES))
def test_typed_contents_of_every_numeric_datatype(datatype: str) -> None:
    values = TYPED_VALUES[datatype]
    parsed = _decode(_typed(datatype, values, [1, 2]), datatype)
    (tensor,) = parsed.inputs
    assert (tensor.name, tensor.datatype, tensor.shape) == ("IN", datatype, (1, 2))
    np.testing.assert_array_equal(np.frombuffer(tensor.data, NUMPY_DTYPE[datatype]), values)


def test_typed_bytes_contents_become_length_prefixed_elements() -> None:
    parsed = _decode(_typed("BYTES", [b"ab", b""], [1, 2]), "STRING")
    assert bytes(parsed.inputs[0].data) == serialize_bytes_elements([b"ab", b""])


def test_raw_contents_are_taken_as_sent_with_requested_outputs_id_and_parameters() -> None:
    data = np.array([[1, 2]], np.float32).tobytes()
    request = pb.ModelInferRequest(
        model_name="m",
        id="req-7",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="IN", datatype="FP32", shape=[1, 2])],
        outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="OUT")],
        raw_input_contents=[data],
    )
    request.parameters["priority"].int64_param = 2
    request.parameters["tag"].string_param = "x"
    request.parameters["flag"].bool_param = True
    parsed = _decode(request)
    assert bytes(parsed.inputs[0].data) == data
    assert parsed.id == "req-7"
    assert parsed.outputs == {"OUT": None}
    assert parsed.parameters == {"priority": 2, "tag": "x", "flag": True}


def _raw(datatype: str, shape: list[int], *buffers: bytes, typed: bool = False) -> Any:
    tensor = pb.ModelInferRequest.InferInputTensor(name="IN", datatype=datatype, shape=shape)
    if typed:
        tensor.contents.fp32_contents.extend([1.0, 2.0])
    return pb.ModelInferRequest(model_name="m", inputs=[tensor], raw_input_contents=buffers)


@pytest.mark.parametrize(
    ("request_", "datatype", "message"),
    [
        (_raw("FP32", [1, 2]), "FP32", "unable to find data for input tensor 'IN' for model 'm'"),
        (
            _raw("FP32", [1, 2], b"\0" * 8, typed=True),
            "FP32",
            "contents field must not be specified when using raw_input_contents for 'IN' for "
            "model 'm'",
        ),
        (_raw("FP32", [1, 2], b"\0" * 8, b"\0" * 8), "FP32", "2 raw_input_contents for 1 inputs"),
        (_raw("FP17", [1, 2], b"\0" * 8), "FP32", "unknown datatype 'FP17'"),
        (_typed("FP32", [1.0], [1, 2]), "FP32", "1 values in contents.fp32_contents"),
        (_typed("INT8", [300, 1], [1, 2]), "INT8", "outside INT8"),
        (_typed("UINT16", [70000, 1], [1, 2]), "UINT16", "outside UINT16"),
        (_raw("BYTES", [1, 2], struct.pack("<I", 1) + b"a"), "STRING", "1 BYTES elements"),
        (_raw("BYTES", [1, 1], struct.pack("<I", 9) + b"a"), "STRING", "runs past its buffer"),
        (_raw("BYTES", [1, 1], b"\1\0"), "STRING", "truncated element length"),
    ],
)
def test_refusals_name_the_input(request_: Any, datatype: str, message: str) -> None:
    with pytest.raises(errors.InvalidInput, match=message.replace("(", r"\(")):
        _decode(request_, datatype)


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_half_floats_have_no_typed_contents(datatype: str) -> None:
    tensor = pb.ModelInferRequest.InferInputTensor(name="IN", datatype=datatype, shape=[1, 2])
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    request = pb.ModelInferRequest(model_name="m", inputs=[tensor])
    with pytest.raises(errors.InvalidInput, match="send it in raw_input_contents"):
        _decode(request, datatype)


def test_shared_memory_needs_a_size_and_classification_is_refused_by_name() -> None:
    request = _raw("FP32", [1, 2], b"\0" * 8)
    request.inputs[0].parameters["shared_memory_region"].string_param = "r"
    with pytest.raises(errors.InvalidInput, match="input 'IN': 'shared_memory_byte_size' must"):
        _decode(request)
    request = _raw("FP32", [1, 2], b"\0" * 8)
    output = request.outputs.add(name="OUT")
    output.parameters["classification"].int64_param = 3
    with pytest.raises(errors.InvalidInput, match="output 'OUT': classification"):
        _decode(request)


def test_the_response_carries_every_output_raw_and_the_id() -> None:
    parsed = ParsedInfer("abc", {}, [], None)
    out = np.arange(4, dtype=np.int64).reshape(2, 2)
    outputs = [
        Tensor("OUT", "INT64", (2, 2), memoryview(out.tobytes())),
        Tensor("S", "BYTES", (1,), serialize_bytes_elements([b"hi"])),
    ]
    response = infer_response(InferOutcome("m", 3, parsed, outputs))
    assert (response.model_name, response.model_version, response.id) == ("m", "3", "abc")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("OUT", "INT64", [2, 2]),
        ("S", "BYTES", [1]),
    ]
    assert response.raw_output_contents[0] == out.tobytes()
    assert response.raw_output_contents[1] == b"\2\0\0\0hi"
    assert not response.outputs[0].HasField("contents")


class _NewError(errors.SluiceError):
    code = "SOMETHING_NEW"
    http_status = 503


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (errors.InvalidInput("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.PayloadTooLarge("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.ModelNotFound("x"), grpc.StatusCode.NOT_FOUND),
        (errors.ModelNotReady("x"), grpc.StatusCode.NOT_FOUND),
        (errors.Unavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (errors.Cancelled("x"), grpc.StatusCode.CANCELLED),
        (errors.ModelExecutionError("x"), grpc.StatusCode.INTERNAL),
        (errors.Unauthorized("x"), grpc.StatusCode.UNAUTHENTICATED),
        (errors.RequestTimeout("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (errors.Conflict("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.ModelConfigError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.NotFound("x"), grpc.StatusCode.NOT_FOUND),
        (errors.Unsupported("x"), grpc.StatusCode.UNIMPLEMENTED),
        (errors.AlreadyExists("x"), grpc.StatusCode.ALREADY_EXISTS),
        (errors.UnknownError("x"), grpc.StatusCode.UNKNOWN),
        (_NewError("x"), grpc.StatusCode.UNAVAILABLE),
        (redis.exceptions.ConnectionError("refused"), grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_every_error_has_its_status(error: Exception, status: grpc.StatusCode) -> None:
    assert grpc_status(error)[0] == status


@pytest.mark.parametrize(
    ("name", "kind", "value", "message"),
    [
        ("sequence_id", "uint64_param", 3, "expected int64_param or string_param."),
        ("sequence_id", "bool_param", True, "expected int64_param or string_param."),
        ("sequence_start", "int64_param", 1, "'sequence_start' parameter, expected bool_param."),
        ("sequence_end", "string_param", "yes", "'sequence_end' parameter, expected bool_param."),
    ],
)
def test_sequence_parameters_of_the_wrong_kind_are_refused_as_triton_refuses_them(
    name: str, kind: str, value: Any, message: str
) -> None:
    request = pb.ModelInferRequest(
        model_name="m",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="IN", datatype="FP32", shape=[1, 2])],
        raw_input_contents=[np.zeros((1, 2), np.float32).tobytes()],
    )
    setattr(request.parameters[name], kind, value)
    with pytest.raises(errors.InvalidInput, match=f"invalid value type for '{name}'") as err:
        _decode(request)
    assert str(err.value.message).endswith(message)


def test_sequence_parameters_of_triton_kinds_pass_as_values() -> None:
    request = pb.ModelInferRequest(
        model_name="m",
        inputs=[pb.ModelInferRequest.InferInputTensor(name="IN", datatype="FP32", shape=[1, 2])],
        raw_input_contents=[np.zeros((1, 2), np.float32).tobytes()],
    )
    request.parameters["sequence_id"].string_param = "session-1"
    request.parameters["sequence_start"].bool_param = True
    assert _decode(request).parameters == {"sequence_id": "session-1", "sequence_start": True}
