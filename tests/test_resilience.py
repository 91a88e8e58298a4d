"""Redis outages and restarts, rolling worker restarts and auth, against separate
`sluice gateway` and `sluice worker` processes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import tritonclient.http as httpclient
from sluice.shared import keys
from sluice.shared.protocol import decode_requests
from tritonclient.utils import InferenceServerException

from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import Service, start_sluice, stop_service, wait_in_hub

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WORKER_READY = "model 'nobatch' versions"


@pytest.fixture
def persistent_redis() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(persistent=True) as server:
        yield server


def _worker(model_repo: Path, url: str) -> Service:
    return start_sluice(
        "worker",
        ["--model-repository", str(model_repo), "--redis-url", url, "--models", "nobatch"],
        ready=WORKER_READY,
    )


def _gateway(url: str, *extra: str) -> Service:
    return start_sluice("gateway", ["--redis-url", url, *extra])


def _infer(client: httpclient.InferenceServerClient, value: float, **kwargs):
    x = np.full((2, 3), value, np.float32)
    tensor = httpclient.InferInput("IN", [2, 3], "FP32")
    tensor.set_data_from_numpy(x)
    return client.async_infer("nobatch", [tensor], headers=AUTH, **kwargs)


def _check(request, value: float) -> None:
    np.testing.assert_array_equal(
        request.get_result().as_numpy("OUT"), np.full((3, 2), value, np.float32)
    )


def _until_ready(client: httpclient.InferenceServerClient, ready: bool) -> None:
    """Poll until readiness flips (the gateway re-checks Redis once a second)."""
    waiter = threading.Event()
    while client.is_server_ready() != ready:
        waiter.wait(0.1)


def test_bearer_token_guards_everything_but_health(model_repo: Path, redis_url: str) -> None:
    worker, gateway = _worker(model_repo, redis_url), _gateway(redis_url, "--auth-token", TOKEN)
    client = httpclient.InferenceServerClient(gateway.http_url)
    try:
        assert client.is_server_live()
        with pytest.raises(InferenceServerException) as err:
            client.get_model_metadata("nobatch")
        assert err.value.status() == "401"
        with pytest.raises(InferenceServerException):
            client.get_model_metadata("nobatch", headers={"Authorization": "Bearer wrong"})
        _check(_infer(client, 1.0), 1.0)
    finally:
        client.close()
        stop_service(gateway)
        stop_service(worker)


def test_redis_outage_past_the_grace_gives_503_and_service_resumes(
    model_repo: Path, persistent_redis: EmbeddedRedis
) -> None:
    url = persistent_redis.url
    worker, gateway = _worker(model_repo, url), _gateway(url, "--redis-outage-grace-s", "1")
    client = httpclient.InferenceServerClient(gateway.http_url, network_timeout=20)
    try:
        _check(_infer(client, 1.0), 1.0)
        persistent_redis.kill()
        with pytest.raises(InferenceServerException) as err:
            _infer(client, 2.0).get_result()
        assert err.value.status() == "503"
        _until_ready(client, False)
        persistent_redis.restart()
        _until_ready(client, True)
        _check(_infer(client, 3.0), 3.0)
    finally:
        client.close()
        stop_service(gateway)
        stop_service(worker)


def test_queued_requests_survive_a_redis_restart(
    model_repo: Path, persistent_redis: EmbeddedRedis
) -> None:
    url = persistent_redis.url
    worker, gateway = _worker(model_repo, url), _gateway(url)
    client = httpclient.InferenceServerClient(gateway.http_url, concurrency=4, network_timeout=60)
    probe = redis.Redis.from_url(url)
    try:
        _check(_infer(client, 0.5), 0.5)
        stop_service(worker)  # nobody serves the model: requests wait in the stream
        pending = [_infer(client, float(v)) for v in range(3)]
        stream = keys.request_stream("nobatch")
        wait_in_hub(
            lambda: sum(len(decode_requests(f)) for _, f in probe.xrange(stream)) >= 3,
            "three requests queued",
        )
        probe.close()
        persistent_redis.restart()
        worker = _worker(model_repo, url)
        for value, request in enumerate(pending):
            _check(request, float(value))
    finally:
        client.close()
        stop_service(gateway)
        stop_service(worker)


def test_rolling_restart_of_all_workers_under_load_loses_nothing(
    model_repo: Path, redis_url: str
) -> None:
    workers = [_worker(model_repo, redis_url), _worker(model_repo, redis_url)]
    gateway = _gateway(redis_url)
    client = httpclient.InferenceServerClient(gateway.http_url, concurrency=8, network_timeout=60)
    sent: list[tuple[float, object]] = []
    stop = threading.Event()

    def load() -> None:
        value = 0.0
        while not stop.is_set():
            batch = [(value + i, _infer(client, value + i)) for i in range(8)]
            sent.extend(batch)
            for v, request in batch:
                _check(request, v)
            value += 8

    loader = threading.Thread(target=load)
    loader.start()
    try:
        for index in range(len(workers)):
            old = workers[index]
            workers[index] = _worker(model_repo, redis_url)
            assert stop_service(old) == 0  # SIGTERM: finishes what it holds, then exits
        stop.set()
        loader.join(60)
        assert not loader.is_alive()
        assert len(sent) >= 8
    finally:
        stop.set()
        client.close()
        stop_service(gateway)
        for worker in workers:
            stop_service(worker)
