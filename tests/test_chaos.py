"""Chaos under load, end to end: `sluice serve --workers 2`, 3,000 requests from 16 client
threads; a worker is SIGKILLed at 25 %, and at 60 % Redis is SIGKILLed and restarted 2 s later
with its append-only file (fsync once a second, so it may lose the last writes) or with no
persistence at all, or the Redis master is SIGKILLed and Sentinel promotes its replica (after
a worker SIGKILL at 25 % too). Clients must not notice."""

from __future__ import annotations

import contextlib
import http.client
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sluice.shared.redis_client import sync_client

from sluice.embedded_redis import EmbeddedRedis
from tests.chaos import Figures, kill_a_worker, run_chaos
from tests.conftest import Service, free_port, needs_single_redis, start_service, stop_service
from tests.redis_sentinel import EmbeddedSentinelSet

pytestmark = needs_single_redis

TOTAL = 3000
CONCURRENCY = 16
REDIS_DOWN_S = 2.0


def _serve(model_repo: Path, redis_url: str, *extra: str) -> list[str]:
    return [
        *("--model-repository", str(model_repo), "--redis-url", redis_url),
        *("--workers", "2", "--bulk-workers", "0", "--claim-idle-ms", "1000", *extra),
    ]


@contextlib.contextmanager
def _log_shown_on_failure(service: Service) -> Iterator[None]:
    """A failure shows what the service printed last (its gateway's and workers' logs)."""
    try:
        yield
    except BaseException:
        print("--- the service's last log lines ---", *service.log[-200:], sep="\n")
        raise


def _assert_clients_did_not_notice(figures: Figures) -> None:
    print(figures.report())
    assert figures.lost == []
    assert figures.wrong == []
    assert figures.duplicated == []
    assert len(figures.outcomes) == TOTAL
    assert figures.ok >= 0.99 * TOTAL, figures.report()


@pytest.fixture(params=["aof-everysec", "no-persistence"])
def aof_redis(request: pytest.FixtureRequest) -> Iterator[EmbeddedRedis]:
    """Restarted with its append-only file (may lose the last second), or empty."""
    persistent = request.param == "aof-everysec"
    with EmbeddedRedis(port=free_port(), persistent=persistent, appendfsync="everysec") as server:
        yield server


def test_a_worker_crash_and_a_redis_restart_under_load(
    model_repo: Path, aof_redis: EmbeddedRedis
) -> None:
    service = start_service(_serve(model_repo, aof_redis.url))

    def restart_redis() -> None:
        aof_redis.kill()
        threading.Event().wait(REDIS_DOWN_S)  # the outage itself, not a synchronisation
        aof_redis.start()

    with _log_shown_on_failure(service):
        try:
            figures = run_chaos(
                service.http_url,
                TOTAL,
                CONCURRENCY,
                [
                    (0.25, "worker SIGKILL", kill_a_worker(aof_redis.url)),
                    (0.60, "Redis SIGKILL + restart", restart_redis),
                ],
            )
        finally:
            stop_service(service)
        _assert_clients_did_not_notice(figures)


def test_a_sentinel_failover_under_load(model_repo: Path) -> None:
    with EmbeddedSentinelSet() as sentinels:
        service = start_service(_serve(model_repo, sentinels.url))
        with _log_shown_on_failure(service):
            try:
                figures = run_chaos(
                    service.http_url,
                    TOTAL,
                    CONCURRENCY,
                    [
                        (0.25, "worker SIGKILL", kill_a_worker(sentinels.url)),
                        (0.60, "master SIGKILL", sentinels.kill_master),
                    ],
                )
                sentinels.wait_promoted()
                connection = http.client.HTTPConnection(*service.http_url.split(":"))
                connection.request("GET", "/v2/health/ready")
                assert connection.getresponse().status == 200
                connection.close()
                client = sync_client(sentinels.url)  # as rq and the command line connect
                assert client.connection_pool.get_master_address()[1] == sentinels.replica.port
                assert client.info("replication")["role"] == "master"
                client.close()
            finally:
                stop_service(service)
            _assert_clients_did_not_notice(figures)
