"""Triton's logging extension: `/v2/logging` and gRPC `LogSettings`, fleet-wide.

The answers were checked side by side against tritonserver 2.51: the same keys, the same
order of taking an update's keys (stopping at the first refused), the same status codes and
texts (a new log file 501, a bad format 503, a value of the wrong type 500; over gRPC
UNIMPLEMENTED and INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
from sluice.shared import keys
from sluice.shared.log_control import LogControl, _formatter, _Levels
from sluice.shared.log_settings import LogSettings, LogSettingsError
from sluice.shared.redis_client import async_client
from tritonclient.grpc import service_pb2 as pb

from tests.conftest import http_json, start_sluice, stop_service

DEFAULTS = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "default",
}


# -- the settings ---------------------------------------------------------------------------


def test_an_update_is_taken_in_tritons_order_up_to_the_first_refused_key() -> None:
    settings, refused = LogSettings().updated(
        {"log_format": "bogus", "log_verbose_level": 2, "log_info": False, "other": 1}
    )
    assert isinstance(refused, LogSettingsError) and refused.kind == "format"
    assert str(refused) == "invalid argument for --log_format, got: bogus"
    # info and the verbose level come before the format: taken
    assert (settings.log_info, settings.log_verbose_level, settings.log_format) == (
        False,
        2,
        "default",
    )


@pytest.mark.parametrize(
    ("changes", "kind", "message"),
    [
        ({"log_file": "/tmp/x", "log_info": False}, "file", "log file location can not be"),
        ({"log_info": "yes"}, "type", "non-boolean as boolean"),
        ({"log_warning": 1}, "type", "non-boolean as boolean"),
        ({"log_verbose_level": -1}, "type", "non-unsigned-integer"),
        ({"log_verbose_level": "2"}, "type", "non-unsigned-integer"),
        ({"log_verbose_level": True}, "type", "non-unsigned-integer"),
    ],
)
def test_refused_updates_name_what_is_wrong(
    changes: dict[str, Any], kind: str, message: str
) -> None:
    settings, refused = LogSettings().updated(changes)
    assert refused is not None and refused.kind == kind and message in str(refused)
    assert settings == LogSettings()  # nothing before the refused key in Triton's order


def test_log_level_reads_as_tritons_flags() -> None:
    assert LogSettings.from_level("warning").to_json() == {**DEFAULTS, "log_info": False}
    assert LogSettings.from_level("debug").log_verbose_level == 1
    error = LogSettings.from_level("error", "/var/log/s.log", "ISO8601")
    assert (error.log_warning, error.log_file, error.log_format) == (
        False,
        "/var/log/s.log",
        "ISO8601",
    )


def test_the_fleet_hash_holds_what_changed_and_overlays_a_processes_own() -> None:
    own = LogSettings.from_level("warning", "/var/log/w.log")
    changed, _ = own.updated({"log_verbose_level": 3, "log_format": "ISO8601"})
    fields = changed.fleet_fields(own)
    assert set(fields) == {"log_verbose_level", "log_format"}
    other = LogSettings.from_level("info")
    seen = other.with_fleet({k.encode(): v for k, v in fields.items()} | {b"log_info": b"[1]"})
    # the fleet's fields win, a field that does not parse is skipped, the file stays its own
    assert seen.to_json() == {**DEFAULTS, "log_verbose_level": 3, "log_format": "ISO8601"}


def _record(level: int) -> logging.LogRecord:
    return logging.LogRecord("sluice.test", level, __file__, 1, "m", None, None)


def test_each_levels_setting_lets_its_records_through_or_not() -> None:
    levels = _Levels()
    levels.settings = LogSettings(log_info=False, log_error=False)
    passed = [levels.filter(_record(level)) for level in (10, 20, 30, 40, 50)]
    assert passed == [False, False, True, False, False]
    levels.settings = LogSettings(log_verbose_level=1)
    assert all(levels.filter(_record(level)) for level in (10, 20, 30, 40, 50))


def test_iso8601_lines_are_stamped_in_utc() -> None:
    record = _record(logging.INFO)
    record.created = 0.0
    assert _formatter("ISO8601").format(record).startswith("1970-01-01T00:00:00Z INFO sluice.test[")
    assert not _formatter("default").format(record).startswith("1970-01-01T")


def test_a_process_follows_the_fleets_settings(redis_url: str) -> None:
    """What every gateway and worker runs: the fleet's settings over its own, taken within
    FOLLOW_INTERVAL_S of their change."""

    async def run() -> LogSettings:
        redis = async_client(redis_url)
        control = LogControl(LogSettings.from_level("warning", "/var/log/w.log"), attached=False)
        follower = asyncio.create_task(control.follow(redis))
        changed, _ = LogSettings().updated({"log_format": "ISO8601", "log_verbose_level": 2})
        await redis.hset(keys.LOG_SETTINGS, mapping=changed.fleet_fields(LogSettings()))

        async def followed() -> None:
            while control.settings.log_format != "ISO8601":
                await asyncio.sleep(0.01)

        try:
            await asyncio.wait_for(followed(), 30)
        finally:
            follower.cancel()
            await redis.aclose()
        return control.settings

    settings = asyncio.run(run())
    assert settings.to_json() == {
        **DEFAULTS,
        "log_file": "/var/log/w.log",
        "log_info": False,  # its own, from --log-level warning
        "log_verbose_level": 2,
        "log_format": "ISO8601",
    }


# -- a fleet: two gateways and a worker ------------------------------------------------------


def _http(address: str, body: bytes | None = None) -> tuple[int, dict[str, Any]]:
    return http_json(f"http://{address}/v2/logging", body)


def _grpc(address: str, **settings: pb.LogSettingsRequest.SettingValue) -> Any:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/LogSettings",
            pb.LogSettingsRequest.SerializeToString,
            pb.LogSettingsResponse.FromString,
        )
        return call(pb.LogSettingsRequest(settings=settings), timeout=30)


def test_settings_change_fleet_wide_over_http_and_grpc(
    model_repo: Path, redis_url: str, tmp_path: Path
) -> None:
    log_file = tmp_path / "fleet.log"
    common = ["--model-repository", str(model_repo), "--redis-url", redis_url]
    explicit = ["--model-control-mode", "explicit"]
    serve = start_sluice("serve", [*common, *explicit, "--log-file", str(log_file)])
    other = start_sluice("gateway", ["--redis-url", redis_url, *explicit])
    try:
        assert _http(serve.http_url) == (200, {**DEFAULTS, "log_file": str(log_file)})
        assert _http(other.http_url) == (200, DEFAULTS)

        # refused as tritonserver refuses them, the keys before the refused one taken
        assert _http(serve.http_url, b'{"log_file": "/tmp/elsewhere"}') == (
            501,
            {"error": "log file location can not be updated through network protocol"},
        )
        assert _http(serve.http_url, b'{"log_info": false, "log_format": "text"}') == (
            503,
            {"error": "invalid argument for --log_format, got: text"},
        )
        status, body = _http(serve.http_url, b"{not json")
        assert status == 500 and body["error"].startswith("failed to parse the request JSON")
        assert _http(serve.http_url, b'{"log_error": "no"}')[0] == 500

        # one gateway's change is the other's at once
        change = b'{"log_format": "ISO8601", "log_verbose_level": 1}'
        status, changed = _http(serve.http_url, change)
        expected = {**DEFAULTS, "log_info": False, "log_verbose_level": 1, "log_format": "ISO8601"}
        assert (status, changed) == (200, {**expected, "log_file": str(log_file)})
        assert _http(other.http_url) == (200, expected)

        # over gRPC, from the other gateway
        value = pb.LogSettingsRequest.SettingValue
        answer = _grpc(other.grpc_url, log_info=value(bool_param=True))
        assert answer.settings["log_info"].bool_param is True
        assert answer.settings["log_format"].string_param == "ISO8601"
        assert _http(serve.http_url)[1]["log_info"] is True
        with pytest.raises(grpc.RpcError) as refused:
            _grpc(other.grpc_url, log_file=value(string_param="/tmp/x"))
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as refused:
            _grpc(other.grpc_url, log_format=value(string_param="text"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "invalid argument for log_format, got: text"

    finally:
        stop_service(other)
        stop_service(serve)
