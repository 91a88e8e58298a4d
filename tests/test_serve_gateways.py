"""`sluice serve --gateways 2`: two gateway processes take connections on the same ports.

serve's own gateway and one `sluice gateway` child bind the HTTP, gRPC and metrics ports with
SO_REUSEPORT; the kernel spreads new connections over both, and each queues through the same
Redis to the same workers. serve says it is ready once both gateways heartbeat, and stops both
(then the workers) on SIGTERM.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import tritonclient.grpc as grpcclient
from sluice.shared import keys
from sluice.shared.redis_client import sync_client

from sluice.cores import cores_available
from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import Service, start_service, start_sluice, stop_service, wait_until
from tests.streams import PLUS_ONE_MODEL, int_model_config, write_python_model

CONNECTIONS = 40


def _infer(http_url: str, value: int) -> int:
    body = {"inputs": [{"name": "IN", "shape": [1, 1], "datatype": "INT64", "data": [value]}]}
    request = urllib.request.Request(
        f"http://{http_url}/v2/models/plus/infer", json.dumps(body).encode()
    )
    with urllib.request.urlopen(request, timeout=30) as reply:  # a connection of its own
        return int(json.loads(reply.read())["outputs"][0]["data"][0])


def test_two_gateways_share_the_ports_and_both_serve(tmp_path: Path) -> None:
    repo = write_python_model(tmp_path, "plus", int_model_config("plus"), PLUS_ONE_MODEL)
    with EmbeddedRedis() as redis_server:
        service = start_service(
            ["--model-repository", str(repo), "--redis-url", redis_server.url, "--gateways", "2"]
        )
        try:
            with urllib.request.urlopen(f"http://{service.http_url}/v2/fleet", timeout=10) as r:
                members = json.loads(r.read())["members"]
            gateways = [m["id"] for m in members if m["kind"] == "gateway"]
            assert len(gateways) == 2
            assert [_infer(service.http_url, i) for i in range(CONNECTIONS)] == [
                i + 1 for i in range(CONNECTIONS)
            ]
            # each gateway answered some: the workers wrote to both gateways' reply streams
            redis = sync_client(redis_server.url)
            assert all(redis.exists(keys.reply_stream(g)) for g in gateways)
            redis.close()
            client = grpcclient.InferenceServerClient(service.grpc_url)
            assert client.is_server_ready()
        finally:
            assert stop_service(service) == 0


def test_a_gateway_alone_runs_as_several_processes_on_its_ports(service: Service) -> None:
    """`sluice gateway --gateways 2` (the gateway image runs one per core)."""
    before = _gateway_ids(service.http_url)
    group = start_sluice("gateway", ["--redis-url", service.redis_url, "--gateways", "2"])
    try:
        wait_until(lambda: len(_gateway_ids(group.http_url) - before) == 2, "both gateways")
        ours = _gateway_ids(group.http_url) - before
        body = {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4}]}
        for _ in range(CONNECTIONS):
            request = urllib.request.Request(
                f"http://{group.http_url}/v2/models/affine/infer", json.dumps(body).encode()
            )
            with urllib.request.urlopen(request, timeout=30) as reply:
                assert reply.status == 200
        redis = sync_client(service.redis_url)
        assert all(redis.exists(keys.reply_stream(g)) for g in ours)
        redis.close()
    finally:
        assert stop_service(group) == 0
    wait_until(lambda: not (_gateway_ids(service.http_url) & ours), "both gateways to leave")


def _gateway_ids(http_url: str) -> set[str]:
    with urllib.request.urlopen(f"http://{http_url}/v2/fleet", timeout=10) as reply:
        members = json.loads(reply.read())["members"]
    return {m["id"] for m in members if m["kind"] == "gateway"}


def test_the_cores_a_cgroup_quota_allows(tmp_path: Path) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # 1.5 CPUs: two processes may run at once
    assert cores_available(str(cpu_max)) == min(2, len(os.sched_getaffinity(0)))
    cpu_max.write_text("max 100000\n")
    assert cores_available(str(cpu_max)) == len(os.sched_getaffinity(0))
    assert cores_available(str(tmp_path / "absent")) == len(os.sched_getaffinity(0))
