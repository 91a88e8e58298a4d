"""The pieces of repository control that need no running fleet: heartbeat compatibility, a
load's outcome from the workers' states, the index, the settings checks, the poll fingerprint,
and the hand-back of a retired queue's entries on a real Redis."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgpack
import pytest
from sluice.gateway.metadata import repository_index
from sluice.gateway.model_table import ModelTable, ModelView
from sluice.shared import keys
from sluice.shared.config_view import ConfigView
from sluice.shared.errors import InvalidInput, SluiceError
from sluice.shared.model_loads import check_load, load_fleet_wide, load_outcome
from sluice.shared.redis_client import async_client
from sluice.shared.registry import (
    LOADING,
    READY,
    UNAVAILABLE,
    UNLOADING,
    Member,
    ModelStatus,
    encode_model_record,
    now_ms,
)
from sluice.shared.repository import fingerprint
from sluice.shared.repository_control import (
    DesiredModel,
    OverridesFull,
    announce_command,
    declare,
    load_model_problem,
    override_path,
    read_desired,
    read_files,
)
from sluice.workers.recovery.handoff import hand_back, undelivered


def _worker(name: str, repository: list[str], **models: ModelStatus) -> Member:
    return Member(name, "worker", "h", 1, 0, dict(models), {}, repository)


def test_a_heartbeat_from_before_states_still_decodes() -> None:
    old = msgpack.packb(
        {"id": "w", "kind": "worker", "host": "h", "pid": 1, "hb": 5, "models": {"m": [[1], None]}}
    )
    member = Member.decode(old)
    status = member.models["m"]
    assert (status.ready_versions, status.current_state, status.generation) == ([1], READY, 0)
    assert member.repository == []
    new = _worker("w", ["m"], m=ModelStatus([], "x", UNLOADING, 7))
    again = Member.decode(new.encode())
    assert again.models["m"] == ModelStatus([], "x", UNLOADING, 7) and again.repository == ["m"]


def test_a_load_is_done_when_one_worker_is_ready_at_its_generation() -> None:
    behind = _worker("a", ["m"], m=ModelStatus([1], None, READY, 3))
    ready = _worker("b", ["m"], m=ModelStatus([1], None, READY, 4))
    assert not load_outcome("m", 4, [behind], False).ready
    assert load_outcome("m", 4, [behind], False).reasons == []  # still loading there
    assert load_outcome("m", 4, [behind, ready], False).ready


def test_a_load_fails_once_every_worker_that_could_load_it_failed() -> None:
    failed = _worker("a", ["m"], m=ModelStatus([], "bad config", UNAVAILABLE, 4))
    kept_old = _worker("b", ["m"], m=ModelStatus([1], "bad file", READY, 4))
    elsewhere = _worker("c", ["other"])
    outcome = load_outcome("m", 4, [failed, kept_old, elsewhere], False)
    assert (outcome.ready, outcome.reasons) == (False, ["bad config", "bad file"])
    # with files every worker can load it: one that has not answered yet keeps it pending
    assert load_outcome("m", 4, [failed, elsewhere], True).reasons == []


def test_the_index_names_never_loaded_models_alone_and_omits_empty_reasons() -> None:
    views = {
        "ready": ModelView("ready", ConfigView.from_json({"name": "ready"}), None, [1, 2], {2}),
        "gone": ModelView(
            "gone",
            ConfigView.from_json({"name": "gone"}),
            None,
            [1],
            reason="unloaded",
            withdrawn=True,
        ),
        "coming": ModelView("coming", None, None, [], state=LOADING),
    }
    index = repository_index(views, ["never", "ready"])
    assert index == [
        {"name": "coming", "version": "", "state": LOADING},
        {"name": "gone", "version": "1", "state": UNAVAILABLE, "reason": "unloaded"},
        {"name": "never"},
        {"name": "ready", "version": "1", "state": UNAVAILABLE},
        {"name": "ready", "version": "2", "state": READY},
    ]
    assert repository_index(views, ["never"], ready_only=True) == [
        {"name": "ready", "version": "2", "state": READY}
    ]


def test_the_table_withdraws_a_model_unloaded_on_purpose() -> None:
    config = {"name": "m", "max_batch_size": 0, "input": [], "output": []}
    records = {b"m": encode_model_record(config, [1], None)}
    serving = [_worker("a", ["m"], m=ModelStatus([1], None, READY, 2))]
    views = ModelTable._views(records, serving, {"m": DesiredModel(3, False)})
    assert views["m"].withdrawn and not views["m"].ready
    assert (views["m"].state, views["m"].reason) == (UNLOADING, None)  # not applied yet
    unloaded = [_worker("a", ["m"], m=ModelStatus([], "unloaded", UNAVAILABLE, 3))]
    views = ModelTable._views(records, unloaded, {"m": DesiredModel(3, False)})
    assert (views["m"].state, views["m"].reason) == (UNAVAILABLE, "unloaded")
    unloading = [_worker("a", ["m"], m=ModelStatus([], None, UNLOADING, 3))]
    views = ModelTable._views(records, unloading, {})
    assert views["m"].withdrawn and views["m"].state == UNLOADING and views["m"].reason is None
    views = ModelTable._views(records, serving, {"m": DesiredModel(2, True)})
    assert views["m"].ready and not views["m"].withdrawn


def test_settings_checks_and_load_parameters() -> None:
    assert load_model_problem("none", ()) is None
    assert "explicit" in (load_model_problem("poll", ("a",)) or "")
    assert load_model_problem("explicit", ("*",)) is None
    assert str(override_path("file:1/model.py")) == "1/model.py"
    for bad in ("file:../x", "file:/etc/passwd", "file:"):
        with pytest.raises(ValueError, match="inside the model directory"):
            override_path(bad)
    check_load("m", '{"max_batch_size": 2}', None)
    # Triton's answer (INTERNAL) to a config override that is no JSON object
    for bad in ("[]", '"parameters": {"config": {{"max_batch_size": "16"}}}'):
        with pytest.raises(SluiceError) as caught:
            check_load("m", bad, None)
        assert caught.value.message == "failed to load 'm', failed to poll from model repository"
        assert caught.value.http_status == 500
    with pytest.raises(InvalidInput, match="'config' is required"):
        check_load("m", None, {"file:1/model.py": b"x"})


def test_the_poll_fingerprint_sees_config_versions_and_files_but_not_caches(tmp_path: Path) -> None:
    model = tmp_path / "m"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text("max_batch_size: 4")
    (model / "1" / "model.py").write_text("x")
    first = fingerprint(model)
    (model / "1" / "__pycache__").mkdir()
    (model / "1" / "__pycache__" / "model.cpython.pyc").write_bytes(b"c")
    assert fingerprint(model) == first  # loading a Python model writes these
    (model / "2").mkdir()
    second = fingerprint(model)
    assert second != first
    os.utime(model / "config.pbtxt", ns=(1, 1))
    assert fingerprint(model) != second


def test_desired_states_and_their_files_round_trip(redis_url: str) -> None:
    async def scenario() -> None:
        redis = async_client(redis_url)
        try:
            files = {"file:1/model.py": b"\x00bytes"}
            first = await declare(redis, "m", loaded=True, config_json='{"a": 1}', files=files)
            second = await declare(redis, "n", loaded=False)
            assert second == first + 1
            desired = await read_desired(redis)
            assert desired["m"] == DesiredModel(first, True, '{"a": 1}', True)
            assert desired["n"] == DesiredModel(second, False)
            assert await read_files(redis, "m") == files
            await declare(redis, "m", loaded=True)  # a plain load drops the files
            assert await read_files(redis, "m") == {}
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_the_fleet_keeps_the_files_of_so_many_models_at_most(redis_url: str) -> None:
    async def scenario() -> None:
        redis = async_client(redis_url)
        files = {"file:1/model.py": b"x"}
        try:
            for name in ("a", "b"):
                await declare(redis, name, loaded=True, files=files, max_file_models=2)
            await declare(redis, "a", loaded=True, files=files, max_file_models=2)  # a reload
            before = await redis.get(keys.DESIRED_GENERATION)
            with pytest.raises(OverridesFull):
                await declare(redis, "c", loaded=True, files=files, max_file_models=2)
            with pytest.raises(InvalidInput, match=r"'c'.*2 models.*--max-override-models"):
                await load_fleet_wide(redis, "c", "{}", files, 1.0, 2)
            assert await redis.get(keys.DESIRED_GENERATION) == before  # nothing written
            assert set(await read_desired(redis)) == {"a", "b"}
            await declare(redis, "c", loaded=True, max_file_models=2)  # no files: no limit
            await declare(redis, "b", loaded=False, max_file_models=2)  # unloaded: room again
            await declare(redis, "c", loaded=True, files=files, max_file_models=2)
            assert await read_files(redis, "c") == files
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_a_worker_behind_a_load_does_not_put_back_the_config_it_replaces(
    redis_url: str,
) -> None:
    """Its heartbeat comes before it has read the new desired state: the record stays the
    one of the worker that applied the load, until this one applies it too."""

    async def scenario() -> None:
        redis = async_client(redis_url)
        try:
            old = encode_model_record({"max_batch_size": 64}, [1], None)
            new = encode_model_record({"max_batch_size": 3}, [1], None)
            assert await redis.execute_command(*announce_command("m", 0, old)) == 1
            generation = await declare(redis, "m", loaded=True, config_json="{}")
            assert await redis.execute_command(*announce_command("m", generation, new)) == 1
            assert await redis.execute_command(*announce_command("m", 0, old)) == 0
            assert await redis.hget(keys.MODELS, "m") == new
            later = encode_model_record({"max_batch_size": 3}, [1, 2], None)
            assert await redis.execute_command(*announce_command("m", generation, later)) == 1
            assert await redis.hget(keys.MODELS, "m") == later
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_a_retired_consumers_entries_go_back_to_the_stream(redis_url: str) -> None:
    """What a stopped queue's cancelled read took is read by the live queue at once, not after
    --claim-idle-ms; nothing is lost or doubled."""

    async def scenario() -> None:
        redis = async_client(redis_url)
        stream = keys.request_stream("handoff")
        try:
            await redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
            for i in range(5):
                await redis.xadd(stream, {"h": f"head{i}", "d": f"data{i}"})
            group = keys.WORKER_GROUP
            await redis.xreadgroup(group, "old", {stream: ">"}, count=3)  # taken, never run
            assert await undelivered(redis, [stream]) == 2
            assert await hand_back(redis, [stream], "old") == 3
            assert await undelivered(redis, [stream]) == 5
            consumers = await redis.xinfo_consumers(stream, group)
            assert all(c["name"] not in (b"old", "old") for c in consumers)
            reply = await redis.xreadgroup(group, "new", {stream: ">"}, count=10)
            heads = sorted(fields[b"h"].decode() for _, fields in reply[0][1])
            assert heads == [f"head{i}" for i in range(5)]
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_a_refresh_names_the_models_unloaded_everywhere(redis_url: str) -> None:
    """What is still queued for a model no worker serves any more is abandoned at the next
    refresh (the gateway fails those requests), not left to its timeout; a model some worker
    still unloads, or serves, is not named."""
    config = {"name": "m", "max_batch_size": 0, "input": [], "output": []}
    statuses = {
        "gone": ModelStatus([], "unloaded", UNAVAILABLE, 3),
        "draining": ModelStatus([], None, UNLOADING, 3),
        "served": ModelStatus([1], None, READY, 3),
    }
    worker = Member("w", "worker", "h", 1, now_ms(), statuses, {}, list(statuses))

    async def refresh() -> list[str]:
        redis = async_client(redis_url)
        try:
            for name in statuses:
                await redis.hset(keys.MODELS, name, encode_model_record(config, [1], None))
            await redis.hset(keys.FLEET, "w", worker.encode())
            named: list[str] = []
            table = ModelTable(redis, "gw", dict, on_unloaded=named.append)
            await table.refresh()
            return named
        finally:
            await redis.aclose()

    assert asyncio.run(refresh()) == ["gone"]
