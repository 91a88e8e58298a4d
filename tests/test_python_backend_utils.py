"""The pieces of sluice's Triton Python backend on their own: pb_utils, loading, one instance's
run of a batch, and the instances around it."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sluice.gateway.core import _forwarded
from sluice.gateway.model_table import ModelView
from sluice.shared.config_view import ConfigView
from sluice.shared.errors import error_from_code
from sluice.shared.model_config import ModelSpec, load_model_config
from sluice.shared.protocol import Request, Result, Tensor
from sluice.shared.stats import BatchStats
from sluice.workers.backends import load_instance
from sluice.workers.instances.lanes import Instances
from sluice.workers.instances.model_instance import Answered, Batch
from sluice.workers.python_backend import pb_utils
from sluice.workers.python_backend.errors import from_sluice_code, to_sluice
from sluice.workers.python_backend.instance import TritonInstance
from sluice.workers.python_backend.loading import complete_config, initialize_args
from sluice.workers.python_backend.messages import response_from_result
from sluice.workers.python_backend.tensors import to_wire

from tests.streams import int_model_config, int_request, write_python_model

CPU = torch.device("cpu")


# -- pb_utils ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("array", "triton_type"),
    [
        (np.array([True, False]), 1),
        (np.array([1, 2], np.uint8), 2),
        (np.array([1, 2], np.int32), 8),
        (np.array([1, 2], np.int64), 9),
        (np.array([1.5], np.float16), 10),
        (np.array([1.5], np.float32), 11),
        (np.array([1.5], np.float64), 12),
        (np.array([b"a", b"bc"], dtype=np.object_), 13),
        (np.array([b"a", b"bc"]), 13),
    ],
)
def test_tensor_from_numpy(array: np.ndarray, triton_type: int) -> None:
    tensor = pb_utils.Tensor("T", array)
    assert tensor.name() == "T"
    assert tensor.triton_dtype() == triton_type
    assert tensor.shape() == list(array.shape)
    assert tensor.is_cpu()
    assert tensor.as_numpy() is array


def test_tritons_type_tables_with_their_gotchas() -> None:
    assert pb_utils.triton_string_to_numpy("TYPE_BOOL") is bool
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    with pytest.raises(KeyError):
        pb_utils.triton_string_to_numpy("TYPE_BF16")
    assert pb_utils.triton_to_numpy_type(13) is np.object_
    assert pb_utils.triton_to_numpy_type(1) is np.bool_
    assert pb_utils.triton_to_numpy_type(11) is np.float32
    assert pb_utils.numpy_to_triton_type(np.float32) == 11
    assert pb_utils.numpy_to_triton_type(np.object_) == 13
    assert pb_utils.numpy_to_triton_type(np.bytes_) == 13


def test_byte_tensors_serialize_in_tritons_layout_and_back() -> None:
    values = np.array([[b"ab", "é"], [b"", 7]], dtype=np.object_)
    flat = pb_utils.serialize_byte_tensor(values)
    assert isinstance(flat, np.ndarray)
    assert (
        flat.item()
        == b"\x02\x00\x00\x00ab\x02\x00\x00\x00\xc3\xa9\x00\x00\x00\x00\x01\x00\x00\x007"
    )
    assert pb_utils.deserialize_bytes_tensor(flat.item()).tolist() == [
        b"ab",
        "é".encode(),
        b"",
        b"7",
    ]
    assert pb_utils.serialize_byte_tensor(np.array([], dtype=np.object_)) == ()
    with pytest.raises(pb_utils.TritonModelException):
        pb_utils.serialize_byte_tensor(np.array([1.0]))


def test_dlpack_both_ways() -> None:
    tensor = pb_utils.Tensor.from_dlpack("X", torch.arange(4, dtype=torch.float32))
    np.testing.assert_array_equal(tensor.as_numpy(), [0, 1, 2, 3])
    back = torch.utils.dlpack.from_dlpack(tensor.to_dlpack())
    assert back.tolist() == [0, 1, 2, 3]
    assert torch.from_dlpack(tensor).tolist() == [0, 1, 2, 3]
    bf16 = pb_utils.Tensor.from_dlpack("B", torch.tensor([1.5], dtype=torch.bfloat16))
    assert bf16.triton_dtype() == 14
    with pytest.raises(pb_utils.TritonModelException, match="BF16"):
        bf16.as_numpy()
    assert torch.from_dlpack(bf16).tolist() == [1.5]


def test_config_look_ups() -> None:
    config = {
        "input": [{"name": "A", "data_type": "TYPE_FP32"}],
        "output": [{"name": "B", "data_type": "TYPE_STRING"}],
    }
    assert pb_utils.get_input_config_by_name(config, "A")["data_type"] == "TYPE_FP32"
    assert pb_utils.get_output_config_by_name(config, "B")["data_type"] == "TYPE_STRING"
    assert pb_utils.get_input_config_by_name(config, "B") is None
    assert not pb_utils.using_decoupled_model_transaction_policy(config)
    decoupled = {"model_transaction_policy": {"decoupled": True}}
    assert pb_utils.using_decoupled_model_transaction_policy(decoupled)


def test_responses_and_errors() -> None:
    out = pb_utils.Tensor("OUT", np.zeros(2, np.float32))
    response = pb_utils.InferenceResponse(output_tensors=[out], parameters={"a": 1})
    assert not response.has_error()
    assert pb_utils.get_output_tensor_by_name(response, "OUT") is out
    assert pb_utils.get_output_tensor_by_name(response, "NONE") is None
    assert json.loads(response.parameters()) == {"a": 1}
    error = pb_utils.TritonError("bad")
    assert error.code() == pb_utils.TritonError.INTERNAL
    failed = pb_utils.InferenceResponse(error=error)
    assert failed.has_error()
    assert failed.error().message() == "bad"
    with pytest.raises(pb_utils.TritonModelException, match="Tensor"):
        pb_utils.InferenceResponse(output_tensors=[np.zeros(2)])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"x": 1.5}, "values to have type bool/int/str, found type <class 'float'>"),
        ({1: "x"}, "keys to have type str, found type <class 'int'>"),
        ('["x"]', "not a JSON object"),
    ],
)
def test_parameters_hold_what_triton_parameters_hold(params: Any, message: str) -> None:
    """bool, int and str values under str keys (Triton's messages), as a dict or its JSON."""
    for made in (pb_utils.InferenceResponse, pb_utils.InferenceRequest):
        with pytest.raises(pb_utils.TritonModelException, match=re.escape(message)):
            made(parameters=params)
    response = pb_utils.InferenceResponse(parameters='{"on": true, "n": 2}')
    assert response.parameter_values == {"on": True, "n": 2}


def test_a_bls_response_carries_its_targets_response_parameters() -> None:
    answered = response_from_result(Result("r", [], parameters={"on": True, "n": 2}))
    assert json.loads(answered.parameters()) == {"on": True, "n": 2}


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (pb_utils.TritonError.UNKNOWN, 400),
        (pb_utils.TritonError.INTERNAL, 500),
        (pb_utils.TritonError.NOT_FOUND, 404),
        (pb_utils.TritonError.INVALID_ARG, 400),
        (pb_utils.TritonError.UNAVAILABLE, 503),
        (pb_utils.TritonError.UNSUPPORTED, 501),
        (pb_utils.TritonError.ALREADY_EXISTS, 400),
        (pb_utils.TritonError.CANCELLED, 400),
    ],
)
def test_a_models_error_code_keeps_tritons_http_status_across_the_wire(
    code: int, status: int
) -> None:
    error = to_sluice(pb_utils.TritonError("why", code))
    rebuilt = error_from_code(error.code, error.message)  # as the gateway does
    assert (rebuilt.http_status, rebuilt.message) == (status, "why")
    assert from_sluice_code(error.code, "why").code() == code


def test_logger_goes_to_python_logging(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="triton_python_backend"):
        pb_utils.Logger.log_info("one")
        pb_utils.Logger.log_warn("two")
        pb_utils.Logger.log_error("three")
        pb_utils.Logger.log_verbose("four")
        pb_utils.Logger.log("five", pb_utils.Logger.ERROR)
    levels = [(r.message, r.levelno) for r in caplog.records]
    assert levels == [
        ("one", logging.INFO),
        ("two", logging.WARNING),
        ("three", logging.ERROR),
        ("four", logging.DEBUG),
        ("five", logging.ERROR),
    ]


def test_model_config_helpers_refuse_what_triton_refuses() -> None:
    config = pb_utils.ModelConfig(
        json.dumps(
            {
                "name": "m",
                "max_batch_size": 8,
                "input": [{"name": "A", "data_type": "TYPE_FP32", "dims": [4]}],
            }
        )
    )
    config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [4]})
    config.add_output({"name": "B", "data_type": "TYPE_INT32", "dims": [1]})
    with pytest.raises(ValueError, match="configuration expects datatype TYPE_FP32"):
        config.add_input({"name": "A", "data_type": "TYPE_INT32", "dims": [4]})
    with pytest.raises(ValueError, match="the model expects dims"):
        config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [5]})
    with pytest.raises(ValueError, match="missing 'dims'"):
        config.add_output({"name": "C", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match="specified max_batch_size 4"):
        config.set_max_batch_size(4)
    config.set_model_transaction_policy({"decoupled": False})
    with pytest.raises(ValueError, match="trying to change decoupled"):
        config.set_model_transaction_policy({"decoupled": True})
    assert [o["name"] for o in config.as_dict()["output"]] == ["B"]


def test_unsupported_calls_say_so() -> None:
    with pytest.raises(pb_utils.TritonModelException, match="not allowed if polling is enabled"):
        pb_utils.load_model("m")  # outside explicit mode, as Triton
    with pytest.raises(pb_utils.TritonModelException, match="files should be a dictionary"):
        pb_utils.load_model("m", "{}", files=[b"x"])
    with pytest.raises(pb_utils.TritonModelException, match="decoupled"):
        pb_utils.InferenceRequest().get_response_sender()


# -- loading ---------------------------------------------------------------------------------


def _spec(tmp_path: Path, name: str, config: str, model: str) -> ModelSpec:
    write_python_model(tmp_path, name, config, textwrap.dedent(model))
    return load_model_config(tmp_path / name, complete=complete_config)


def test_initialize_args_name_each_instance_after_its_group(tmp_path: Path) -> None:
    config = int_model_config("grouped") + (
        'instance_group [ { name: "a", count: 2, kind: KIND_CPU }, { count: 1, kind: KIND_CPU } ]'
    )
    spec = _spec(tmp_path, "grouped", config, "class TritonPythonModel: pass\n")
    names = [initialize_args(spec, tmp_path / "grouped", 1, CPU, i) for i in range(3)]
    assert [a["model_instance_name"] for a in names] == ["a_0", "a_1", "grouped_1_0"]
    assert {a["model_instance_kind"] for a in names} == {"CPU"}
    assert json.loads(names[0]["model_config"]) == spec.config_json


def test_two_models_with_the_same_file_name_do_not_clash(tmp_path: Path) -> None:
    model = """
        import numpy as np
        import triton_python_backend_utils as pb_utils
        VALUE = {value}
        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT",
                        np.full((1, 1), VALUE, np.int64))]) for _ in requests]
    """
    answers = []
    for name, value in (("first", 1), ("second", 2)):
        spec = _spec(tmp_path, name, int_model_config(name), model.format(value=value))
        instance = load_instance(spec, tmp_path / name, 1, CPU)
        assert isinstance(instance, TritonInstance)
        (outputs,), _ = instance.run(Batch([int_request(0, "r")], [1]))
        assert not isinstance(outputs, Exception)
        answers.append(np.frombuffer(outputs[0].data, np.int64).tolist())
    assert answers == [[1], [2]]
    assert "triton_python_backend_utils" in sys.modules


def test_auto_complete_runs_before_validation(tmp_path: Path) -> None:
    model = """
        class TritonPythonModel:
            @staticmethod
            def auto_complete_config(config):
                config.add_input({"name": "IN", "data_type": "TYPE_INT64", "dims": [1]})
                config.add_output({"name": "OUT", "data_type": "TYPE_INT64", "dims": [1]})
                config.set_max_batch_size(2)
                return config
    """
    spec = _spec(tmp_path, "auto", 'backend: "python"\n', model)
    assert [i.name for i in spec.inputs] == ["IN"]
    assert spec.max_batch_size == 2


def test_auto_complete_that_returns_nothing_is_a_load_error(tmp_path: Path) -> None:
    model = """
        class TritonPythonModel:
            @staticmethod
            def auto_complete_config(config):
                config.set_max_batch_size(2)
    """
    with pytest.raises(Exception, match=r"must return the pb_utils\.ModelConfig"):
        _spec(tmp_path, "auto", 'backend: "python"\n', model)


def test_a_failing_initialize_is_a_load_error_naming_the_file(tmp_path: Path) -> None:
    model = """
        class TritonPythonModel:
            def initialize(self, args):
                raise ValueError("no weights")
    """
    spec = _spec(tmp_path, "broken", int_model_config("broken"), model)
    with pytest.raises(Exception, match="initialize failed: ValueError: no weights") as err:
        load_instance(spec, tmp_path / "broken", 1, CPU)
    assert "model.py" in str(err.value)


# -- one instance's run, and the instances around it ----------------------------------------

PLUS = """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        calls = []

        {kind}def execute(self, requests):
            TritonPythonModel.calls.append(len(requests))
            values = [int(r.inputs()[0].as_numpy()[0][0]) for r in requests]
            if 13 in values:
                raise RuntimeError("thirteen")
            odd = pb_utils.TritonError("odd", pb_utils.TritonError.INVALID_ARG)
            return [
                pb_utils.InferenceResponse(error=odd)
                if v % 2
                else pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.full((1, 1), v + 1))])
                for v in values
            ]
"""


def _instance(tmp_path: Path, kind: str = "") -> TritonInstance:
    spec = _spec(tmp_path, "plus", int_model_config("plus"), PLUS.format(kind=kind))
    instance = load_instance(spec, tmp_path / "plus", 1, CPU)
    assert isinstance(instance, TritonInstance)
    return instance


def _values(answer: object) -> object:
    if isinstance(answer, Answered) and answer.error is not None:
        return ("model's", type(answer.error).__name__, str(answer.error))
    if isinstance(answer, Exception):
        return (type(answer).__name__, str(answer))
    assert isinstance(answer, list)
    return [np.frombuffer(t.data, np.int64).tolist() for t in answer]


@pytest.mark.parametrize("kind", ["", "async "])
def test_each_request_gets_its_own_answer(tmp_path: Path, kind: str) -> None:
    instance = _instance(tmp_path, kind)
    answers, _ = instance.run(Batch([int_request(i, "r") for i in (2, 3, 4)], [1, 1, 1]))
    assert [_values(a) for a in answers] == [[[3]], ("model's", "InvalidInput", "odd"), [[5]]]
    assert instance.model.calls == [3]
    instance.close()


def test_outputs_not_requested_are_left_out(tmp_path: Path) -> None:
    instance = _instance(tmp_path)
    request = int_request(2, "r")
    request.outputs = ()
    (answer,), _ = instance.run(Batch([request], [1]))
    assert answer == []


def test_instances_never_split_a_triton_models_batch(tmp_path: Path) -> None:
    """The culprit's neighbours fail with it, and execute ran once: no halving."""
    instance = _instance(tmp_path)
    spec = load_model_config(tmp_path / "plus")
    instances = Instances(spec, {1: [instance]}, CPU)
    requests = [int_request(i, "r") for i in (2, 13, 4, 6)]

    async def run() -> list:
        stats = BatchStats(1, 4, 0)
        return await instances.run_isolating(0, requests, [1] * 4, stats)

    results = asyncio.run(run())
    message = "Failed to process the request(s) for model 'plus', message: RuntimeError: thirteen"
    assert [r.error for r in results] == [("INTERNAL", message)] * 4
    assert instance.model.calls == [4]
    assert instances.last_run_ns is None  # never runs on the worker's loop
    instances.shutdown()


def test_shutdown_finalizes_each_instance_once(tmp_path: Path) -> None:
    model = """
        class TritonPythonModel:
            finalized = 0
            def execute(self, requests):
                return []
            def finalize(self):
                TritonPythonModel.finalized += 1
    """
    spec = _spec(tmp_path, "fin", int_model_config("fin"), model)
    lanes = [load_instance(spec, tmp_path / "fin", 1, CPU, i) for i in range(2)]
    instances = Instances(spec, {1: lanes}, CPU)
    instances.shutdown()
    instances.shutdown()
    # each instance imported the file as a module of its own, as Triton's stub per instance
    finalized = [type(lane.model).finalized for lane in lanes if isinstance(lane, TritonInstance)]
    assert finalized == [1, 1]


def test_inputs_are_views_over_the_request_bytes(tmp_path: Path) -> None:
    seen: list[np.ndarray] = []

    class Keep:
        def execute(self, requests: list) -> list:
            seen.extend(r.inputs()[0].as_numpy() for r in requests)
            return [pb_utils.InferenceResponse() for _ in requests]

    blob = np.array([[7]], np.int64).tobytes()
    request = Request("r", 1, 0, "r", [Tensor("IN", "INT64", (1, 1), memoryview(blob))])
    TritonInstance("keep", Keep(), tmp_path, {"OUT": "INT64"}).run(Batch([request], [1]))
    assert seen[0].tolist() == [[7]]
    assert not seen[0].flags.writeable
    assert seen[0].base is not None


def test_each_model_imports_its_own_helper_module(tmp_path: Path) -> None:
    """Two models with a `helper.py` each, in one process: each gets its own."""
    model = """
        import numpy as np
        import triton_python_backend_utils as pb_utils
        from helper import VALUE
        class TritonPythonModel:
            def execute(self, requests):
                return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT",
                        np.full((1, 1), VALUE, np.int64))]) for _ in requests]
    """
    answers = []
    for name, value in (("one", 1), ("two", 2)):
        spec = _spec(tmp_path, name, int_model_config(name), model)
        (tmp_path / name / "1" / "helper.py").write_text(f"VALUE = {value}\n")
        instance = load_instance(spec, tmp_path / name, 1, CPU)
        assert isinstance(instance, TritonInstance)
        (outputs,), _ = instance.run(Batch([int_request(0, "r")], [1]))
        assert isinstance(outputs, list)
        answers.append(np.frombuffer(outputs[0].data, np.int64).tolist())
    assert answers == [[1], [2]]
    assert "helper" not in sys.modules


@pytest.mark.parametrize(
    ("array", "datatype", "expected"),
    [
        (np.zeros((0, 4), np.float32), "FP32", np.zeros((0, 4), np.float32)),
        (np.arange(6).reshape(2, 3).T, "INT64", np.arange(6).reshape(2, 3).T.copy()),
        (np.arange(3, dtype=np.int32), "FP32", np.arange(3, dtype=np.float32)),
        (np.array([True, False]), "BOOL", np.array([True, False])),
    ],
    ids=["empty", "transposed", "converted", "bool"],
)
def test_outputs_go_out_as_the_configs_datatype(
    array: np.ndarray, datatype: str, expected: np.ndarray
) -> None:
    wire = to_wire(pb_utils.Tensor("OUT", array), datatype)
    assert (wire.datatype, wire.shape) == (datatype, expected.shape)
    assert bytes(wire.data) == expected.tobytes()


def test_an_output_of_the_wrong_kind_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="output 'OUT' is BYTES in the config"):
        to_wire(pb_utils.Tensor("OUT", np.zeros(2)), "BYTES")
    with pytest.raises(ValueError, match="output 'OUT' is FP32 in the config"):
        to_wire(pb_utils.Tensor("OUT", np.array([b"a"], dtype=np.object_)), "FP32")


def test_the_gateway_forwards_custom_parameters_to_python_models_only() -> None:
    params = {"priority": 1, "custom": "x", "binary_data_output": True}
    python = ModelView("p", ConfigView.from_json({"name": "p", "backend": "python"}), None, [1])
    torchscript = ModelView(
        "t", ConfigView.from_json({"name": "t", "backend": "pytorch"}), None, [1]
    )
    assert _forwarded(python, params) == {"priority": 1, "custom": "x"}
    assert _forwarded(torchscript, params) == {"priority": 1}
