"""`sluice serve --gateways 2`: two gateway processes take connections on the same ports.

serve's own gateway and one `sluice gateway` child bind the HTTP, gRPC and metrics ports with
SO_REUSEPORT; the kernel spreads new connections over both, and each queues through the same
Redis to the same workers. serve says it is ready once both gateways heartbeat, and stops both
(then the workers) on SIGTERM.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import tritonclient.grpc as grpcclient
from sluice.shared import keys
from sluice.shared.redis_client import sync_client

from sluice.embedded_redis import EmbeddedRedis
from tests.conftest import start_service, stop_service
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
