"""The chaos run of tests/test_chaos.py as a script that prints its figures.

`sluice serve --workers 2` on the `affine` test model against a Redis on loopback; N requests
from C client threads; a worker SIGKILLed at 25 %, and at 60 % either Redis SIGKILLed and
restarted after --down seconds (with its append-only file, fsync every second, unless
--no-persistence), or, with --sentinel, the master of a master + replica + 3 sentinels
SIGKILLed so that the replica is promoted.

    .venv/bin/python benchmarks/chaos.py [--requests 3000] [--concurrency 16] [--sentinel]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sluice.embedded_redis import EmbeddedRedis  # noqa: E402
from tests.chaos import Fault, kill_a_worker, run_chaos  # noqa: E402
from tests.conftest import free_port, start_service, stop_service  # noqa: E402
from tests.redis_sentinel import EmbeddedSentinelSet  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--down", dest="down_s", type=float, default=2.0, help="seconds Redis stays down"
    )
    parser.add_argument("--no-persistence", action="store_true")
    parser.add_argument("--sentinel", action="store_true", help="a failover, not a restart")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        repo = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "models"
        shutil.copytree(ROOT / "tests" / "model_repo" / "affine", repo / "affine")
        outage_s: dict[str, float] = {}
        if args.sentinel:
            sentinels = stack.enter_context(EmbeddedSentinelSet())
            url = sentinels.url

            def redis_fault() -> None:
                started_s = time.monotonic()
                sentinels.kill_master()
                sentinels.wait_promoted()
                outage_s["until the sentinels named the new master"] = time.monotonic() - started_s

            name = "master SIGKILL"
        else:
            server = EmbeddedRedis(
                port=free_port(), persistent=not args.no_persistence, appendfsync="everysec"
            )
            url = stack.enter_context(server).url

            def redis_fault() -> None:
                started_s = time.monotonic()
                server.kill()
                threading.Event().wait(args.down_s)
                server.start()
                outage_s["Redis down"] = time.monotonic() - started_s

            name = "Redis SIGKILL + restart"
        service = start_service(
            [
                *("--model-repository", str(repo), "--redis-url", url, "--workers", "2"),
                *("--bulk-workers", "0", "--claim-idle-ms", "1000"),
            ]
        )
        stack.callback(stop_service, service)
        faults: list[Fault] = [
            (0.25, "worker SIGKILL", kill_a_worker(url)),
            (0.60, name, redis_fault),
        ]
        figures = run_chaos(service.http_url, args.requests, args.concurrency, faults)
    print(figures.report())
    for what, duration_s in outage_s.items():
        print(f"{what}: {duration_s:.2f} s")


if __name__ == "__main__":
    main()
