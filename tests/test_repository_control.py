"""Model repository control against a real fleet: the three modes, loads and unloads through
tritonclient and raw HTTP, the index's states, two workers following a load and a worker
started later catching up, and a config override applied under load with nothing lost."""

from __future__ import annotations

import http.client
import json
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import pytest
import tritonclient.http as httpclient
from sluice.shared import keys
from sluice.shared.redis_client import sync_client
from sluice.shared.registry import Member, live_members, now_ms
from tritonclient.utils import InferenceServerException

from sluice.embedded_redis import EmbeddedRedis
from sluice.settings import WorkerSettings
from tests.conftest import HERE, Service, start_sluice, stop_service, wait_until
from tests.redis_cluster import EmbeddedCluster

NOT_EXPLICIT = "explicit model load / unload is not allowed if polling is enabled"
NO_VERSIONS = "Request for unknown model: '{}' has no available versions"
EXPLICIT = ["--model-control-mode", "explicit"]
SERVE = ["--grpc-port", "0", "--bulk-workers", "0", "--claim-idle-ms", "1000"]


def _call(service: Service, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    host, port = service.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body))
        response = conn.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def _index(service: Service, ready: bool | None = None) -> dict[str, list[dict[str, Any]]]:
    status, body = _call(
        service, "POST", "/v2/repository/index", None if ready is None else {"ready": ready}
    )
    assert status == 200, body
    by_name: dict[str, list[dict[str, Any]]] = {}
    for entry in body:
        by_name.setdefault(entry["name"], []).append(entry)
    return by_name


def _workers(redis_url: str) -> list[Member]:
    client = sync_client(redis_url)
    try:
        members, _ = live_members(client.hgetall(keys.FLEET), now_ms())
    finally:
        client.close()
    return [m for m in members if m.kind == "worker"]


@contextmanager
def _client(service: Service) -> Iterator[httpclient.InferenceServerClient]:
    """tritonclient (gevent underneath: main thread only; threads use `_infer`)."""
    client = httpclient.InferenceServerClient(service.http_url, network_timeout=120)
    try:
        yield client
    finally:
        client.close()


def _infer(service: Service, model: str, tensor: str, row: float) -> tuple[int, Any]:
    """One [1, 4] FP32 request filled with `row`, over plain HTTP (any thread)."""
    body = {"inputs": [{"name": tensor, "shape": [1, 4], "datatype": "FP32", "data": [row] * 4}]}
    return _call(service, "POST", f"/v2/models/{model}/infer", body)


def _output(answer: tuple[int, Any]) -> list[float]:
    status, body = answer
    assert status == 200, body
    data: list[float] = body["outputs"][0]["data"]
    return data


def _repo(tmp_path: Path, *models: str) -> Path:
    repo = tmp_path / "models"
    for model in models:
        shutil.copytree(HERE / "model_repo" / model, repo / model)
    return repo


# -- settings --------------------------------------------------------------------------------


def test_load_model_needs_explicit_mode_and_a_lone_wildcard() -> None:
    base: dict[str, Any] = {"model_repository": Path("."), "redis_url": "redis://x"}
    with pytest.raises(ValueError, match="requires setting '--model-control-mode=explicit'"):
        WorkerSettings(**base, load_model=("a",))
    with pytest.raises(ValueError, match="must be the ONLY startup model"):
        WorkerSettings(**base, load_model=("a", "*"), model_control_mode="explicit")
    settings = WorkerSettings(**base, load_model=("a", "b"), model_control_mode="explicit")
    assert settings.config().load_model == ("a", "b")


# -- mode none (the session's service) --------------------------------------------------------


def test_none_mode_refuses_loads_and_unloads_as_triton(service: Service) -> None:
    for action in ("load", "unload"):
        status, body = _call(service, "POST", f"/v2/repository/models/affine/{action}")
        assert (status, body) == (503, {"error": NOT_EXPLICIT})
    with _client(service) as client, pytest.raises(InferenceServerException, match="polling"):
        client.load_model("affine")
    metadata = _call(service, "GET", "/v2")[1]
    assert "model_repository(unload_dependents)" in metadata["extensions"]


def test_none_mode_index_omits_empty_reasons_and_filters_ready(service: Service) -> None:
    index = _index(service)
    assert index["affine"] == [{"name": "affine", "version": "1", "state": "READY"}]
    assert index["broken"][0]["state"] == "UNAVAILABLE" and index["broken"][0]["reason"]
    ready = _index(service, ready=True)
    assert "affine" in ready and "broken" not in ready
    assert _call(service, "POST", "/v2/repository/index", {"ready": "yes"})[0] == 400


# -- explicit mode: a fleet of two workers -----------------------------------------------------


@pytest.fixture(scope="module")
def explicit(
    scratch_redis: EmbeddedRedis | EmbeddedCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """`sluice serve` in explicit mode, two workers, affine loaded at start."""
    client = sync_client(scratch_redis.url)
    client.flushall()
    client.close()
    repo = _repo(tmp_path_factory.mktemp("explicit"), "affine", "batch8", "broken")
    args = ["--model-repository", str(repo), "--redis-url", scratch_redis.url, "--workers", "2"]
    mode = ["--model-control-mode", "explicit", "--load-model", "affine"]
    service = start_sluice("serve", [*args, *mode, *SERVE])
    wait_until(lambda: len(_workers(scratch_redis.url)) == 2, "two workers")
    yield service
    stop_service(service)


def test_explicit_start_loads_only_the_named_models(explicit: Service) -> None:
    index = _index(explicit)
    assert index["affine"][0]["state"] == "READY"
    assert index["batch8"] == [{"name": "batch8"}]  # never loaded: its name alone
    assert index["broken"] == [{"name": "broken"}]
    with _client(explicit) as client:
        assert not client.is_model_ready("batch8")
        assert {"name": "batch8"} in client.get_model_repository_index()
    assert _call(explicit, "GET", "/v2/health/ready")[0] == 200


def _serves(redis_url: str, model: str) -> list[str]:
    """The live workers with a version of `model` ready."""
    return [w.id for w in _workers(redis_url) if (s := w.models.get(model)) and s.ready_versions]


def test_a_load_is_followed_by_every_worker_and_an_unload_finishes(explicit: Service) -> None:
    with _client(explicit) as client:
        client.load_model("batch8")  # returns once ready on a worker
        assert client.is_model_ready("batch8")
        wait_until(lambda: len(_serves(explicit.redis_url, "batch8")) == 2, "both workers")
        assert _output(_infer(explicit, "batch8", "IN", 1.0)) == [2.0] * 4

        client.load_model("batch8")  # again, unchanged: nothing happens, still ready
        assert client.is_model_ready("batch8")

        client.unload_model("batch8")  # returns at once: UNLOADING, then UNAVAILABLE "unloaded"
        assert not client.is_model_ready("batch8")
        assert _index(explicit)["batch8"][0]["state"] in ("UNLOADING", "UNAVAILABLE")
        wait_until(lambda: _index(explicit)["batch8"][0].get("reason") == "unloaded", "unload")
        assert _index(explicit)["batch8"][0]["state"] == "UNAVAILABLE"
        assert not _serves(explicit.redis_url, "batch8")
    status, body = _infer(explicit, "batch8", "IN", 1.0)
    assert (status, body) == (404, {"error": NO_VERSIONS.format("batch8")})  # as Triton 2.51
    assert _call(explicit, "GET", "/v2/models/batch8/config")[0] == 404
    job = {"inputs": [{"name": "IN", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4}]}
    for path in ("/v2/models/batch8/jobs", "/v2/models/batch8/bulk"):
        assert _call(explicit, "POST", path, job) == (404, {"error": NO_VERSIONS.format("batch8")})
    assert _call(explicit, "GET", "/v2/health/ready")[0] == 200  # unloaded on purpose


def test_failed_and_unknown_loads_answer_as_triton(explicit: Service) -> None:
    status, body = _call(explicit, "POST", "/v2/repository/models/broken/load")
    assert status == 400
    assert body["error"].startswith("load failed for model 'broken': ")
    assert "preferred_batch_size" in body["error"]
    entry = _index(explicit)["broken"][0]
    assert entry["state"] == "UNAVAILABLE" and "preferred_batch_size" in entry["reason"]

    status, body = _call(explicit, "POST", "/v2/repository/models/nope/load")
    poll_failed = "failed to load 'nope', failed to poll from model repository"
    assert (status, body) == (500, {"error": poll_failed})

    load = "/v2/repository/models/affine/load"
    status, body = _call(explicit, "POST", load, {"parameters": {"config": "{not json"}})
    poll_failed = "failed to load 'affine', failed to poll from model repository"
    assert (status, body) == (500, {"error": poll_failed})
    status, body = _call(explicit, "POST", load, {"parameters": {"file:1/model.py": "eA=="}})
    assert status == 400 and "'config' is required" in body["error"]
    config = json.dumps({"name": "affine"})
    outside = {"parameters": {"config": config, "file:../x": "eA=="}}
    status, body = _call(explicit, "POST", load, outside)
    assert status == 400 and "'file:../x'" in body["error"]
    # Triton 2.51 answers 200 to a parameter that is no boolean (read as false)
    unload = {"parameters": {"unload_dependents": 1}}
    assert _call(explicit, "POST", "/v2/repository/models/batch8/unload", unload) == (200, None)


def test_a_failed_reload_leaves_the_model_serving(explicit: Service) -> None:
    bad = {**AFFINE_OVERRIDE, "dynamic_batching": {"preferred_batch_size": [16]}}
    load = {"parameters": {"config": json.dumps(bad)}}
    status, body = _call(explicit, "POST", "/v2/repository/models/affine/load", load)
    assert status == 400 and "preferred_batch_size" in body["error"]
    assert _index(explicit)["affine"] == [{"name": "affine", "version": "1", "state": "READY"}]
    assert _output(_infer(explicit, "affine", "X", 1.0)) == [3.0] * 4
    config = _call(explicit, "GET", "/v2/models/affine/config")[1]
    assert config["max_batch_size"] == 64  # the repository's, as before the failed load


def test_a_worker_started_after_a_load_follows_it(explicit: Service) -> None:
    with _client(explicit) as client:
        client.load_model("batch8")
    args = list(explicit.process.args)  # type: ignore[arg-type]
    repo = args[args.index("--model-repository") + 1]
    first = {w.id for w in _workers(explicit.redis_url)}
    url = explicit.redis_url
    late = start_sluice(
        "worker",
        [*("--model-repository", repo, "--redis-url", url), *EXPLICIT, "--load-model", "nope"],
        ready="'batch8' versions",
    )
    try:

        def late_worker() -> Member | None:
            return next((w for w in _workers(url) if w.id not in first), None)

        def followed_all() -> bool:
            worker = late_worker()
            return worker is not None and {"affine", "batch8", "broken"} <= set(worker.models)

        wait_until(lambda: len(_serves(url, "batch8")) == 3, "the late worker serving batch8")
        wait_until(followed_all, "the late worker following every load")
        worker = late_worker()
        assert worker is not None
        # the fleet's last loads, failed ones too: broken, and affine's bad override (the
        # workers that loaded affine before it keep serving their earlier config)
        for model, reason in (("broken", "preferred_batch_size"), ("affine", "preferred")):
            status = worker.models[model]
            assert not status.ready_versions and reason in (status.reason or "")
        assert len(_serves(url, "affine")) == 2
        assert any("--load-model 'nope': no such model" in line for line in late.log)
    finally:
        stop_service(late)


def _stream_length(redis_url: str, model: str) -> int:
    client = sync_client(redis_url)
    try:
        return int(client.xlen(keys.request_stream(model)))
    finally:
        client.close()


def _done(futures: list[Future[Any]]) -> int:
    return sum(f.done() for f in futures)


BATCH8_SLOW = {
    "name": "batch8",
    "backend": "python",
    "max_batch_size": 8,
    "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}],
    "dynamic_batching": {"max_queue_delay_microseconds": 5_000_000},
}


def test_unload_finishes_the_requests_already_queued(explicit: Service) -> None:
    """batch8, loaded here to wait up to 5 s for a full batch of 8: the four requests sent
    before the unload are still queued when it comes, and are answered."""
    with _client(explicit) as client:
        client.load_model("batch8", config=json.dumps(BATCH8_SLOW))
        wait_until(lambda: len(_serves(explicit.redis_url, "batch8")) == 2, "both workers")
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_infer, explicit, "batch8", "IN", i) for i in range(4)]
            wait_until(  # each queued or (if a reload's old queue ran it) answered
                lambda: _stream_length(explicit.redis_url, "batch8") + _done(futures) == 4,
                "all queued",
            )
            client.unload_model("batch8")
            answers = [f.result() for f in futures]
        assert _infer(explicit, "batch8", "IN", 9.0)[0] == 404  # new ones are refused
    for i, answer in enumerate(answers):
        assert _output(answer) == [2.0 * i] * 4
    wait_until(lambda: _index(explicit)["batch8"][0].get("reason") == "unloaded", "unloaded")


def test_file_parameters_load_a_model_no_repository_holds(explicit: Service) -> None:
    """`file:` parameters form the model's directory: every worker writes them to a private
    folder and loads from there."""
    config = {**AFFINE_OVERRIDE, "name": "shipped", "instance_group": [{"count": 1}]}
    model_py = (HERE / "model_repo" / "affine" / "1" / "model.py").read_bytes()
    with _client(explicit) as client:
        client.load_model("shipped", config=json.dumps(config), files={"file:1/model.py": model_py})
        assert client.is_model_ready("shipped")
        wait_until(lambda: len(_serves(explicit.redis_url, "shipped")) == 2, "both workers")
        assert _output(_infer(explicit, "shipped", "X", 4.0)) == [9.0] * 4
        client.unload_model("shipped")
    wait_until(lambda: _state(explicit, "shipped") == "UNAVAILABLE", "shipped unloaded")


def test_a_name_that_is_no_directory_reaches_no_filesystem_call(
    explicit: Service, tmp_path: Path
) -> None:
    """A load's name becomes a directory on every worker: `..` is refused at the gateway, and
    a desired state stored under another directory's path (past the gateways, straight into
    Redis) is dropped by the workers, those that start later included."""
    victim = tmp_path / "victim"
    (victim / "keep").mkdir(parents=True)
    config = json.dumps({**AFFINE_OVERRIDE, "name": "x"})
    load = {"parameters": {"config": config, "file:1/model.py": "eA=="}}
    for name in ("..", "a%5Cb"):
        status, body = _call(explicit, "POST", f"/v2/repository/models/{name}/load", load)
        assert status == 400 and "model name" in body["error"], body
    redis = sync_client(explicit.redis_url)
    try:
        assert not {b"..", b"a\\b"} & set(redis.hkeys(keys.DESIRED))
        packed = msgpack.packb({"file:1/model.py": b"x"})
        record = msgpack.packb([10**9, True, config, True])
        redis.hset(keys.DESIRED_FILES, str(victim), packed)
        redis.hset(keys.DESIRED, str(victim), record)
        redis.publish(keys.DESIRED_CHANNEL, str(victim))

        def dropped(log: list[str]) -> bool:
            return any("dropped, not applied" in line and str(victim) in line for line in log)

        wait_until(lambda: dropped(explicit.log), "the workers dropping the desired state")
        args = list(explicit.process.args)  # type: ignore[arg-type]
        repo = args[args.index("--model-repository") + 1]
        late = start_sluice(
            "worker",
            [*("--model-repository", repo, "--redis-url", explicit.redis_url), *EXPLICIT],
            ready="dropped, not applied",
        )
        stop_service(late)
        assert dropped(late.log)
        assert (victim / "keep").is_dir()
    finally:
        redis.hdel(keys.DESIRED, str(victim))
        redis.hdel(keys.DESIRED_FILES, str(victim))
        redis.close()


AFFINE_OVERRIDE = {
    "name": "affine",
    "backend": "python",
    "max_batch_size": 3,
    "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}],
    "dynamic_batching": {"max_queue_delay_microseconds": 20000},
    "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
}


def _batch_counts(service: Service) -> dict[int, int]:
    """Batches run per batch size, fleet-wide, from the statistics."""
    stats = _call(service, "GET", "/v2/models/affine/stats")[1]["model_stats"][0]
    return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}


def test_a_config_override_under_load_changes_batching_and_loses_nothing(
    explicit: Service,
) -> None:
    stop = threading.Event()
    answers: list[tuple[float, tuple[int, Any]]] = []

    def client_loop(offset: int) -> None:
        row = float(offset)
        while not stop.is_set():
            answers.append((row, _infer(explicit, "affine", "X", row)))
            row += 100

    with ThreadPoolExecutor(8) as pool:
        loops = [pool.submit(client_loop, i) for i in range(8)]
        try:
            # 8 clients batch together under max 64 (on a loaded machine, not at once)
            wait_until(lambda: max(_batch_counts(explicit)) > 3, "batches of more than 3")
            with _client(explicit) as client:
                client.load_model("affine", config=json.dumps(AFFINE_OVERRIDE))
            wait_until(lambda: _old_queues_retired(explicit.redis_url), "the old queues retired")
            settled = _batch_counts(explicit)  # every batch of the old queues is counted by now
            seen = len(answers)
            wait_until(lambda: len(answers) >= seen + 120, "traffic under the new config")
        finally:
            stop.set()
        for loop in loops:
            loop.result()
    rows = [row for row, _ in answers]
    assert len(rows) == len(set(rows))  # one answer each, none lost or doubled
    for row, answer in answers:
        assert _output(answer) == [2 * row + 1] * 4
    after = _batch_counts(explicit)
    grown = {size for size, count in after.items() if count > settled.get(size, 0)}
    assert grown and max(grown) <= 3, (settled, after)  # the new max_batch_size caps batches
    assert _call(explicit, "GET", "/v2/models/affine/config")[1]["max_batch_size"] == 3
    assert all(w.info["instances"]["affine"] == 2 for w in _workers(explicit.redis_url))
    status, body = _infer_rows(explicit, 4)  # the gateway validates with the new signature
    assert status == 400 and "batch-size must be <= 3" in body["error"]


def _old_queues_retired(redis_url: str) -> bool:
    """A reload's queue reads as `<worker>/<n>`; the one it replaced leaves the consumer
    group once it has answered everything it held (workers/recovery/handoff.py)."""
    client = sync_client(redis_url)
    try:
        consumers = client.xinfo_consumers(keys.request_stream("affine"), keys.WORKER_GROUP)
    finally:
        client.close()
    names = [c["name"].decode() if isinstance(c["name"], bytes) else c["name"] for c in consumers]
    return bool(names) and all("/" in name for name in names)


def _infer_rows(service: Service, rows: int) -> tuple[int, Any]:
    tensor = {"name": "X", "shape": [rows, 4], "datatype": "FP32", "data": [1.0] * (4 * rows)}
    return _call(service, "POST", "/v2/models/affine/infer", {"inputs": [tensor]})


# -- poll mode -------------------------------------------------------------------------------


def test_poll_mode_follows_new_changed_and_removed_models(tmp_path: Path) -> None:
    with EmbeddedRedis() as redis:  # apart from the explicit fleet's, which still runs
        _poll_mode(redis.url, tmp_path)


def _state(service: Service, model: str) -> str | None:
    entries = _index(service).get(model)
    return entries[0].get("state") if entries else None


def _poll_mode(redis_url: str, tmp_path: Path) -> None:
    repo = _repo(tmp_path, "batch8")
    args = ["--model-repository", str(repo), "--redis-url", redis_url]
    mode = ["--model-control-mode", "poll", "--repository-poll-secs", "0.2"]
    service = start_sluice("serve", [*args, *mode, *SERVE])
    try:
        assert _call(service, "POST", "/v2/repository/models/batch8/load")[0] == 503
        shutil.copytree(HERE / "model_repo" / "affine", repo / ".affine")
        (repo / ".affine").rename(repo / "affine")  # appears whole, as a poll must see it
        wait_until(lambda: _state(service, "affine") == "READY", "affine loaded")
        assert _output(_infer(service, "affine", "X", 1.0)) == [3.0] * 4

        config = repo / "affine" / "config.pbtxt"
        edited = config.with_name(".config.pbtxt")
        edited.write_text(config.read_text().replace("max_batch_size: 64", "max_batch_size: 5"))
        edited.replace(config)  # whole at once: a poll never reads it half written

        def max_batch_size() -> int:
            return int(_call(service, "GET", "/v2/models/affine/config")[1]["max_batch_size"])

        wait_until(lambda: max_batch_size() == 5, "affine reloaded")
        assert _output(_infer(service, "affine", "X", 2.0)) == [5.0] * 4

        shutil.rmtree(repo / "affine")
        wait_until(lambda: _state(service, "affine") != "READY", "affine unloading")
        assert _infer(service, "affine", "X", 1.0)[0] == 404
        wait_until(lambda: _index(service)["affine"][0].get("reason") == "unloaded", "unloaded")
        assert _state(service, "affine") == "UNAVAILABLE"
        assert _state(service, "batch8") == "READY"
        assert _call(service, "GET", "/v2/health/ready")[0] == 200  # removed on purpose

        shutil.copytree(HERE / "model_repo" / "affine", repo / ".affine")
        (repo / ".affine").rename(repo / "affine")  # back again: loaded again
        wait_until(lambda: _state(service, "affine") == "READY", "affine loaded again")
        assert _output(_infer(service, "affine", "X", 1.0)) == [3.0] * 4
    finally:
        stop_service(service)
