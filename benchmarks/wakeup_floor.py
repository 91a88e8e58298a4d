"""The latency floor this machine puts under one request at concurrency 1.

A request at c=1 wakes a sleeping thread eight times on its way through sluice: client →
gateway → Redis → worker loop → instance thread → worker loop → Redis → gateway → client.
At c=1 the adaptive batching delay (opt-in) sends each request at once, so all of them add to the
model time: four direct wakes (client → gateway, loop → instance thread and back, gateway
→ client) and two hops through Redis (the gateway's XADD answering the worker's blocked
XREADGROUP, the worker's XADD answering the gateway's blocked XREAD; with `BATCH_DELAY
fixed` the first falls inside the delay). Each wake of an idle process costs what the
kernel (and, in a VM, the hypervisor) charges to get another CPU running. This measures a
wake on a pipe between two processes, on one CPU and across two, and the Redis hop between
two redis-py clients, each after an idle gap as at c=1, and prints the floor they set under
p50 at c=1 before sluice's own code runs.

    python benchmarks/wakeup_floor.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import redis

from sluice.embedded_redis import EmbeddedRedis

ROUNDS = 400
IDLE_GAP_S = 0.003
#: how long the reader's XREAD blocks for the next entry.
BLOCK_MS = 1000
#: direct wakes and Redis hops on a request's path at c=1 (see above).
DIRECT_WAKES = 4
REDIS_HOPS = 2


def pipe_round_trip_us(cpu_a: int, cpu_b: int) -> float:
    """Median round trip between two processes pinned to the given CPUs (two wakes)."""
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, {cpu_b})
        for _ in range(ROUNDS):
            os.read(to_child, 1)
            os.write(from_child, b"x")
        os._exit(0)
    os.sched_setaffinity(0, {cpu_a})
    samples_us = []
    for _ in range(ROUNDS):
        time.sleep(IDLE_GAP_S)
        start_ns = time.perf_counter_ns()
        os.write(from_parent, b"x")
        os.read(to_parent, 1)
        samples_us.append((time.perf_counter_ns() - start_ns) / 1e3)
    os.waitpid(pid, 0)
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return statistics.median(samples_us)


def _blocked_reader(url: str) -> None:
    client = redis.Redis.from_url(url)
    last, samples_us = b"$", []
    while len(samples_us) < ROUNDS:
        reply = client.xread({"floor": last}, block=BLOCK_MS, count=16)
        now_ns = time.time_ns()
        for _stream, entries in reply or ():
            for entry_id, fields in entries:
                last = entry_id
                samples_us.append((now_ns - int(fields[b"t"])) / 1e3)
    print(statistics.median(samples_us))


def xadd_to_blocked_xread_us(url: str) -> float:
    """Median time from XADD to the blocked XREAD returning in another process."""
    reader = subprocess.Popen(
        [sys.executable, __file__, "--reader", url], stdout=subprocess.PIPE, text=True
    )
    client = redis.Redis.from_url(url)
    # entries added before the reader first blocks are not counted; it counts the later ones
    while reader.poll() is None:
        time.sleep(IDLE_GAP_S)
        client.xadd("floor", {"t": str(time.time_ns()).encode()})
    assert reader.stdout is not None
    return float(reader.stdout.read())


def main() -> None:
    same_us = pipe_round_trip_us(0, 0)
    print(f"pipe round trip, both on CPU 0: {same_us:.0f} µs ({same_us / 2:.0f} µs per wake)")
    cross_us = same_us
    if (os.cpu_count() or 1) > 1:
        cross_us = pipe_round_trip_us(0, 1)
        print(
            f"pipe round trip, CPU 0 <-> CPU 1: {cross_us:.0f} µs ({cross_us / 2:.0f} µs per wake)"
        )
    with EmbeddedRedis() as server:
        hop_us = xadd_to_blocked_xread_us(server.url)
    print(f"Redis hop: XADD -> a blocked XREAD returns in another process: {hop_us:.0f} µs")
    floor_us = DIRECT_WAKES * cross_us / 2 + REDIS_HOPS * hop_us
    print(
        f"floor at c=1 beyond model time: {DIRECT_WAKES} wakes x {cross_us / 2:.0f} µs + "
        f"{REDIS_HOPS} Redis hops x {hop_us:.0f} µs = {floor_us / 1e3:.2f} ms"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reader"]:
        _blocked_reader(sys.argv[2])
    else:
        main()
