"""Triton's trace extension (`mode=triton`, TIMESTAMPS): settings, sampling, the file.

The settings' answers were checked side by side against tritonserver 2.51: the same strings,
the same statuses and texts (a new file 501, a number that is no string 500, a bad number or
OFF with another level 400, a level without a file 400, an unknown model 400).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from sluice.gateway.trace_file import TraceFile, trace_objects
from sluice.gateway.tracing import FleetTracing
from sluice.shared.datatypes import NUMPY_DTYPE
from sluice.shared.protocol import (
    ProtocolError,
    Request,
    Result,
    Tensor,
    decode_requests,
    decode_results,
    encode_requests,
    encode_results,
)
from sluice.shared.redis_client import async_client
from sluice.shared.trace_settings import (
    TraceSettingsError,
    parse_trace_config,
    parse_update,
)
from tritonclient.grpc import service_pb2 as pb

from tests.conftest import http_json, start_sluice, stop_service

STAMPS = [
    "REQUEST_START",
    "QUEUE_START",
    "COMPUTE_START",
    "COMPUTE_INPUT_END",
    "COMPUTE_OUTPUT_START",
    "COMPUTE_END",
    "REQUEST_END",
]


# -- settings ------------------------------------------------------------------------------


def test_trace_config_reads_as_tritonserver_takes_it() -> None:
    settings = parse_trace_config(
        ["triton,file=/tmp/t.json", "level=TIMESTAMPS", "rate=1", "count=5", "log-frequency=2"]
    )
    assert settings.to_json() == {
        "trace_level": ["TIMESTAMPS"],
        "trace_rate": "1",
        "trace_count": "5",
        "log_frequency": "2",
        "trace_file": "/tmp/t.json",
        "trace_mode": "triton",
    }
    assert parse_trace_config([]).to_json()["trace_level"] == ["OFF"]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (["level=TIMESTAMPS"], "trace file name is not given"),
        (["level=LOUD"], "level must be"),
        (["speed=3"], "unknown setting 'speed'"),
        (["rate=often"], "Unable to parse 'trace_rate', got: often"),
        (["opentelemetry,resource=plain"], "expected resource=<key>=<value>"),
        (["opentelemetry,bsp_max_queue_size=0"], "must be at least 1"),
        (["jaeger,rate=1"], "unknown mode 'jaeger'"),
        (["rate"], "expected [<mode>,]<setting>=<value>"),
    ],
)
def test_a_bad_trace_config_says_what_is_wrong(entries: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        parse_trace_config(entries)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"trace_file": "/tmp/x"}, 501, "trace file location can not be updated"),
        ({"trace_rate": 5}, 500, "attempt to access JSON non-string as string"),
        ({"trace_level": "TIMESTAMPS"}, 500, "attempt to access JSON non-array as array"),
        ({"trace_rate": "abc"}, 400, "Unable to parse 'trace_rate', got: abc"),
        ({"trace_count": "-2"}, 400, "Expecting value >= -1, got:-2"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, 400, "Expect only one trace level 'OFF'"),
    ],
)
def test_updates_are_refused_as_tritonserver_refuses_them(
    body: dict[str, Any], status: int, message: str
) -> None:
    with pytest.raises(TraceSettingsError) as refused:
        parse_update(body)
    assert refused.value.status == status and message in str(refused.value)


def test_update_values_as_tritonserver_reads_them() -> None:
    assert parse_update({"trace_rate": "-1"}) == {"rate": 2**32 - 1}  # read as uint32
    assert parse_update({"trace_level": ["BOGUS"], "x": "1"}) == {}  # ignored, no change
    assert parse_update({"trace_level": ["OFF"], "trace_count": None}) == {
        "level": [],
        "count": None,  # null: back to the value below (the global one, the command line's)
    }


# -- the wire -------------------------------------------------------------------------------


def _wire(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    """An entry's fields as Redis gives them back."""
    return {name.encode(): value for name, value in fields.items()}


def test_a_traced_request_and_its_timestamps_cross_the_wire_out_of_the_models_sight() -> None:
    request = Request("g:1", 1, 5, "replies", [], parameters={"priority": 1}, traced=True)
    (decoded,) = decode_requests(_wire(encode_requests([request])))
    assert decoded.traced and decoded.parameters == {"priority": 1}
    (plain,) = decode_requests(_wire(encode_requests([Request("g:2", 1, 5, "replies", [])])))
    assert not plain.traced
    stamped = Result("g:1", parameters={"p": 1}, timestamps=[1, 2, 3, 4])
    (result,) = decode_results(_wire(encode_results([stamped])))
    assert (result.parameters, result.timestamps) == ({"p": 1}, [1, 2, 3, 4])
    (bare,) = decode_results(_wire(encode_results([Result("g:1", timestamps=[1, 2, 3, 4])])))
    assert (bare.parameters, bare.timestamps) == (None, [1, 2, 3, 4])


def test_an_opentelemetry_traces_context_crosses_the_wire_out_of_the_models_sight() -> None:
    context = f"00-{'a' * 32}-{'b' * 16}-01"
    request = Request("r", 1, 5, "reply", [], None, {"k": 1}, traced=True)
    request.traceparent, request.model_span = context, True
    (decoded,) = decode_requests(_wire(encode_requests([request])))
    assert (decoded.traced, decoded.traceparent, decoded.model_span) == (True, context, True)
    assert decoded.parameters == {"k": 1}
    request.traceparent, request.model_span = None, False  # Triton's mode: a flag alone
    (decoded,) = decode_requests(_wire(encode_requests([request])))
    assert (decoded.traced, decoded.traceparent, decoded.model_span) == (True, None, False)


def test_a_malformed_trace_is_a_protocol_error() -> None:
    fields = _wire(encode_results([Result("g:1", timestamps=[1, 2, 3, 4])]))
    fields[b"h"] = fields[b"h"].replace(b"\x94\x01\x02\x03\x04", b"\x92\x01\x02")
    with pytest.raises(ProtocolError, match="four timestamps"):
        decode_results(fields)


# -- the file -------------------------------------------------------------------------------


def _trace(n: int) -> list[dict[str, Any]]:
    return trace_objects(n, "m", 1, f"r{n}", [("REQUEST_START", n)])


def test_the_file_is_written_every_log_frequency_traces_and_the_rest_at_stop(
    tmp_path: Path,
) -> None:
    file = TraceFile(str(tmp_path / "t.json"), max_held=3)
    for n in range(1, 4):
        file.add(_trace(n), log_frequency=2)
    assert [o["id"] for o in json.loads((tmp_path / "t.json.0").read_text())] == [1, 1, 2, 2]
    assert not (tmp_path / "t.json").exists()
    file.close()
    assert json.loads((tmp_path / "t.json").read_text()) == _trace(3)
    # with no frequency, what is held is bounded: it goes to the next file past max_held
    unbounded = TraceFile(str(tmp_path / "u.json"), max_held=2)
    for n in range(1, 4):
        unbounded.add(_trace(n), log_frequency=0)
    assert len(json.loads((tmp_path / "u.json.0").read_text())) == 4
    # nor do the tensors' values grow it past its bytes
    heavy = TraceFile(str(tmp_path / "h.json"), max_held_bytes=100)
    heavy.add(_trace(1), log_frequency=0, size=60)
    assert not (tmp_path / "h.json.0").exists()
    heavy.add(_trace(2), log_frequency=0, size=60)
    assert len(json.loads((tmp_path / "h.json.0").read_text())) == 4


def _tensor(name: str, datatype: str, shape: tuple[int, ...], values: list[Any]) -> Tensor:
    return Tensor(name, datatype, shape, np.array(values, NUMPY_DTYPE[datatype]).tobytes())


def test_level_tensors_writes_inputs_and_outputs_as_tritonserver_does(
    tmp_path: Path, redis_url: str
) -> None:
    async def run() -> None:
        redis = async_client(redis_url)
        path = tmp_path / "t.json"
        entries = [f"file={path}", "level=TIMESTAMPS", "level=TENSORS", "rate=1"]
        settings = parse_trace_config([*entries, "log-frequency=1"])
        tracing = FleetTracing(redis, settings, TraceFile(str(path)))
        trace = tracing.begin("add_sub", 10)
        assert trace is not None
        trace.version, trace.request_id = 1, "r1"
        trace.inputs = [_tensor("INPUT0", "FP32", (1, 4), [1, 2, 3, 4.5])]
        trace.stamps.append(("QUEUE_START", 11))
        outputs = [
            _tensor("OUTPUT0", "FP32", (1, 4), [2, 4, 6, 8.5]),
            _tensor("REQUESTS", "INT32", (1, 1), [1]),
        ]
        tracing.end(trace, Result("x", outputs, timestamps=[12, 13, 14, 15]), 16)
        await redis.aclose()

    asyncio.run(run())
    objects = json.loads((tmp_path / "t.json.0").read_text())
    # tritonserver 2.51's file for this add_sub request (its HTTP_* stamps aside)
    assert [o.get("activity") or o.get("timestamps", [{}])[0].get("name") for o in objects] == [
        None,
        "REQUEST_START",
        "QUEUE_START",
        "TENSOR_QUEUE_INPUT",
        "TENSOR_BACKEND_OUTPUT",
        "TENSOR_BACKEND_OUTPUT",
        *STAMPS[2:],
    ]
    assert objects[0] == {"id": 1, "model_name": "add_sub", "model_version": 1, "request_id": "r1"}
    assert objects[3]["tensor"] == {
        "name": "INPUT0",
        "data": "1,2,3,4.5",
        "shape": "1,4",
        "dtype": "FP32",
    }
    assert objects[4]["tensor"]["data"] == "2,4,6,8.5"
    assert objects[5]["tensor"] == {
        "name": "REQUESTS",
        "data": "1",
        "shape": "1,1",
        "dtype": "INT32",
    }


def test_every_rateth_request_is_traced_while_the_count_lasts(redis_url: str) -> None:
    async def run() -> list[int]:
        redis = async_client(redis_url)
        baseline = parse_trace_config(["file=/unused", "level=TIMESTAMPS", "rate=2"])
        tracing = FleetTracing(redis, baseline, TraceFile("/unused"))
        await tracing.update(None, {"trace_count": "2"})
        traced = [tracing.begin("m", n) is not None for n in range(7)]
        left = tracing.settings("m").count
        await tracing.update("m", {"trace_rate": "1", "trace_count": "1"})  # the model's own
        traced += [tracing.begin("m", n) is not None for n in range(2)]
        await redis.aclose()
        return [int(t) for t in traced] + [left]

    assert asyncio.run(run()) == [0, 1, 0, 1, 0, 0, 0, 1, 0, 0]


# -- a fleet --------------------------------------------------------------------------------


def _trace_setting(address: str, path: str = "", body: bytes | None = None) -> Any:
    return http_json(f"http://{address}/v2{path}/trace/setting", body)


def _infer(address: str, request_id: str) -> None:
    body = {
        "id": request_id,
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
    }
    request = urllib.request.Request(
        f"http://{address}/v2/models/affine/infer", data=json.dumps(body).encode()
    )
    urllib.request.urlopen(request, timeout=60).close()


def test_a_fleets_traces_follow_one_gateways_settings(
    model_repo: Path, redis_url: str, tmp_path: Path
) -> None:
    file = tmp_path / "trace.json"
    tracing = ["--trace-config", f"triton,file={file}", "--trace-config", "level=TIMESTAMPS"]
    common = ["--model-repository", str(model_repo), "--redis-url", redis_url]
    serve = start_sluice("serve", [*common, *tracing, "--trace-config", "log-frequency=2"])
    other = start_sluice("gateway", ["--redis-url", redis_url])
    try:
        status, shown = _trace_setting(serve.http_url)
        assert status == 200 and shown["trace_rate"] == "1000" and shown["trace_file"] == str(file)
        assert _trace_setting(other.http_url)[1]["trace_level"] == ["OFF"]  # its own CLI

        # the other gateway sets the fleet's rate and a model's count; serve's follows
        assert _trace_setting(other.http_url, body=b'{"trace_rate": "2"}')[0] == 200
        path = "/models/affine"
        status, model = _trace_setting(other.http_url, path, b'{"trace_count": "2"}')
        assert status == 200 and (model["trace_rate"], model["trace_count"]) == ("2", "2")
        assert _trace_setting(serve.http_url, "/models/nope") == (
            400,
            {"error": "Request for unknown model : nope"},
        )
        # serve's gateway reads the fleet's settings for a GET (and every second)
        assert _trace_setting(serve.http_url, path)[1]["trace_count"] == "2"
        for n in range(8):
            _infer(serve.http_url, f"r{n}")
        objects = json.loads((tmp_path / "trace.json.0").read_text())
        headers = [o for o in objects if "model_name" in o]
        assert [h["request_id"] for h in headers] == ["r1", "r3"]  # every 2nd, 2 in all
        assert headers[0]["model_name"] == "affine" and headers[0]["model_version"] == 1
        for header in headers:
            mine = [o for o in objects if o["id"] == header["id"] and "timestamps" in o]
            stamps = [o["timestamps"][0] for o in mine]
            assert [s["name"] for s in stamps] == STAMPS
            times = [s["ns"] for s in stamps]
            assert times == sorted(times)
        assert _trace_setting(serve.http_url, path)[1]["trace_count"] == "0"

        # over gRPC, from the other gateway: the model's count back to the global one
        with grpc.insecure_channel(other.grpc_url) as channel:
            call = channel.unary_unary(
                "/inference.GRPCInferenceService/TraceSetting",
                pb.TraceSettingRequest.SerializeToString,
                pb.TraceSettingResponse.FromString,
            )
            cleared = pb.TraceSettingRequest.SettingValue()
            answer = call(
                pb.TraceSettingRequest(model_name="affine", settings={"trace_count": cleared})
            )
            assert list(answer.settings["trace_count"].value) == ["-1"]
            bad = pb.TraceSettingRequest.SettingValue(value=["x"])
            with pytest.raises(grpc.RpcError) as refused:
                call(pb.TraceSettingRequest(settings={"trace_rate": bad}))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == "Unable to parse 'trace_rate', got: x"
            new_file = pb.TraceSettingRequest.SettingValue(value=["/tmp/x"])
            with pytest.raises(grpc.RpcError) as refused:
                call(pb.TraceSettingRequest(settings={"trace_file": new_file}))
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        stop_service(other)
        stop_service(serve)
