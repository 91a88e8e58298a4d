"""What the least a wire can do costs Redis on this machine, beside what sluice costs.

`redis_cost.py` measures sluice's Redis CPU per inference; this asks what any design moving
the same bytes at the same pace would pay. One run measures `sluice serve` on the reference
MLP at c=64 (as `redis_cost.py` does) and then, on a Redis of its own started the same way,
two bare processes that stand for a gateway and a worker and do nothing but the wire:

- the gateway writes each batch's requests as **one** stream entry (header bytes and the
  tensors, 2 KiB per request), the coalescing sluice can only approach, and reads one reply
  entry per batch from its reply stream;
- the worker reads with `XREADGROUP`, holds the batch for the model's time (a sleep that
  paces batches at sluice's measured rate), and answers with one reply `XADD` and one `XACK`
  and `XDEL` in one pipeline.

Two batches are in flight, as at c=64 with sluice's batch of about 31. Two ways to send:

- **four events**: each client's read is sent again on its own, as sluice does (the gateway's
  reply read, its request write 1 ms later as clients answer, the worker's answer, its read);
- **two events**: each client's read goes in the same write as its next write (the gateway's
  request XADD with its reply XREAD, the worker's answer with its next XREADGROUP), the fewest
  times a Redis can be woken per batch by two clients.

Both run at sluice's measured batch size and batch rate; two events also with 64 B a request
in place of 2 KiB (the events without the bytes), unpaced (as fast as it goes), and unpaced
with batches of 64 (the coalesced pattern of the Redis cost figures sluice's design started
from). Then two events at sluice's pace with several gateway and worker pairs on the one
model's stream (`--pairs`, each worker paced as the one before, each gateway reading its own
reply stream): what a batch costs a Redis that more of a fleet keeps busy.

It prints Redis CPU (`INFO cpu`, less the idle rate) per inference and per batch and the
times redis-server slept per batch, for each.

    python benchmarks/redis_floor.py [--window-s 3] [--rounds 3] [--pairs 2,4,8]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from redis_cost import build_repository, idle_rates, measure, serving, sleeps_so_far
from scale_workers import snapshot

from sluice.embedded_redis import EmbeddedRedis, redis_server_binary

REQUESTS = "floor:{m}:requests"
GROUP = "workers"
PAYLOAD = 2048
#: what a request's msgpack header takes in sluice's entry (id, version, time, route, spec).
HEADER_PER_REQUEST = 90
#: the time between a reply and the clients' next requests reaching the gateway.
CLIENT_GAP_S = 0.001
BLOCK_MS = 1000
WARMUP_S = 1.0
#: how often the run asks whether every gateway and worker has started.
START_POLL_S = 0.05
#: how long a stopped gateway or worker may take to exit before it is killed.
STOP_TIMEOUT_S = 10


@dataclass(frozen=True, slots=True)
class Pattern:
    label: str
    joined: bool
    #: batches per second the worker's model time allows (0: unpaced)
    rate: float
    #: requests per batch (0: sluice's measured batch)
    batch: int = 0
    #: tensor bytes per request, in and out
    payload: int = PAYLOAD
    #: gateway and worker pairs, all on the one request stream
    pairs: int = 1


@dataclass(frozen=True, slots=True)
class Figure:
    label: str
    batch: float
    batches_per_s: float
    us_per_inference: float
    us_per_batch: float
    sleeps_per_batch: float


def reply_stream(gateway: int | bytes) -> str:
    """A gateway's reply stream (its number, as the request entries carry it)."""
    return f"floor:{{gw{int(gateway)}}}:replies"


def gateway(url: str, pattern: Pattern, batch: int, stop: Synchronized[int], index: int) -> None:
    """Two batches in flight; each reply entry is answered with a new batch's entry."""
    sends, reads = redis.Redis.from_url(url), redis.Redis.from_url(url)
    entry = ("XADD", REQUESTS, "*", b"g", index, b"h", os.urandom(HEADER_PER_REQUEST * batch))
    entry += (b"d", os.urandom(pattern.payload * batch))
    for _ in range(2):
        sends.execute_command(*entry)
    connection = reads.connection_pool.get_connection()
    last: bytes | str = "0-0"
    connection.send_command(*_reply_read(index, last))
    reply = connection.read_response()
    while not stop.value:
        if not reply:
            connection.send_command(*_reply_read(index, last))
            reply = connection.read_response()
            continue
        entries = _entries(reply)
        last = entries[-1][0]
        if pattern.joined:  # the clients' next requests, then the next read, in one write
            time.sleep(CLIENT_GAP_S)
            commands = [entry] * len(entries) + [_reply_read(index, last)]
            connection.send_packed_command(connection.pack_commands(commands))
            reply = [connection.read_response() for _ in commands][-1]
        else:  # the next read at once, the clients' next requests as they come
            connection.send_command(*_reply_read(index, last))
            time.sleep(CLIENT_GAP_S)
            for _ in entries:
                sends.execute_command(*entry)
            reply = connection.read_response()


def _entries(reply: object) -> list[list[object]]:
    """A one-stream read's entries, whether the protocol answers with a map or pairs."""
    (entries,) = reply.values() if isinstance(reply, dict) else (s for _, s in reply)  # type: ignore[attr-defined]
    return entries  # type: ignore[no-any-return]


def _reply_read(gateway: int, last: bytes | str) -> tuple[object, ...]:
    return ("XREAD", "COUNT", 16, "BLOCK", BLOCK_MS, "STREAMS", reply_stream(gateway), last)


def worker(
    url: str,
    pattern: Pattern,
    batch: int,
    done: Synchronized[int],
    stop: Synchronized[int],
    index: int,
) -> None:
    """Read, hold for the model's time, answer; the next read alone or with the answer."""
    client = redis.Redis.from_url(url)
    answer = (b"h", os.urandom(40 * batch), b"d", os.urandom(pattern.payload * batch))
    read = ("XREADGROUP", "GROUP", GROUP, f"w{index}", "COUNT", 1, "BLOCK", BLOCK_MS)  # a batch
    read += ("STREAMS", REQUESTS, ">")
    connection = client.connection_pool.get_connection()
    tick_s = time.monotonic()
    connection.send_command(*read)
    entries = connection.read_response()
    while not stop.value:
        if not entries:
            connection.send_command(*read)
            entries = connection.read_response()
            continue
        read_entries = _entries(entries)
        ids = [entry_id for entry_id, _ in read_entries]
        if pattern.rate:  # the model's time: batches at the measured rate
            tick_s = max(tick_s + 1 / pattern.rate, time.monotonic() - 1 / pattern.rate)
            time.sleep(max(0.0, tick_s - time.monotonic()))
        commands: list[tuple[object, ...]] = [
            ("XADD", reply_stream(fields[1]), "MAXLEN", "~", 1000, "*", *answer)
            for _, fields in read_entries  # fields: b"g", the gateway, then the rest
        ]
        commands += [
            ("XACK", REQUESTS, GROUP, *ids),
            ("XDEL", REQUESTS, *ids),
        ]
        if pattern.joined:
            commands.append(read)
        connection.send_packed_command(connection.pack_commands(commands))
        replies = [connection.read_response() for _ in commands]
        with done.get_lock():
            done.value += len(ids) * batch
        if pattern.joined:
            entries = replies[-1]
        else:
            connection.send_command(*read)
            entries = connection.read_response()


def run_pattern(pattern: Pattern, batch: int, window_s: float) -> Figure:
    with EmbeddedRedis(port=16480) as server:
        client = redis.Redis.from_url(server.url)
        client.xgroup_create(REQUESTS, GROUP, id="0", mkstream=True)
        idle_cpu, idle_sleeps = idle_rates(client, server)
        context = multiprocessing.get_context("spawn")
        done, stop = context.Value("q", 0), context.Value("b", 0)
        processes = []
        for index in range(pattern.pairs):
            args = (server.url, pattern, batch, done, stop, index)
            processes.append(context.Process(target=worker, args=args))
            args = (server.url, pattern, batch, stop, index)
            processes.append(context.Process(target=gateway, args=args))
        for process in processes:
            process.start()
        while not done.value:  # all started (spawned processes import torch first)
            if not all(process.is_alive() for process in processes):
                stop.value = 1
                raise RuntimeError(f"{pattern.label}: a gateway or worker died at its start")
            time.sleep(START_POLL_S)
        time.sleep(WARMUP_S)
        snap0, sleeps0, done0 = snapshot(client), sleeps_so_far(server), done.value
        time.sleep(window_s)
        snap1, sleeps1, done1 = snapshot(client), sleeps_so_far(server), done.value
        stop.value = 1
        for process in processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
        client.close()
    span_s = snap1.at_s - snap0.at_s
    inferences = max(1, done1 - done0)
    batches = inferences / batch
    cpu_us = max(0.0, (snap1.cpu_s - snap0.cpu_s - idle_cpu * span_s) * 1e6)
    return Figure(
        label=pattern.label,
        batch=batch,
        batches_per_s=batches / span_s,
        us_per_inference=cpu_us / inferences,
        us_per_batch=cpu_us / batches,
        sleeps_per_batch=max(0.0, sleeps1 - sleeps0 - idle_sleeps * span_s) / batches,
    )


def sluice_figure(window_s: float) -> Figure:
    with tempfile.TemporaryDirectory(prefix="redis-floor-") as scratch:
        repo = build_repository(Path(scratch) / "models", [])
        with serving("sluice", 0, repo, None, None, unix=False) as side:
            level = measure(side, 0, 64, window_s)
    return Figure(
        label="sluice serve, reference MLP, c=64",
        batch=level.batch,
        batches_per_s=level.throughput / level.batch,
        us_per_inference=level.us_per_inference,
        us_per_batch=level.us_per_batch,
        sleeps_per_batch=level.sleeps_per_batch,
    )


def median(figures: list[Figure]) -> Figure:
    return sorted(figures, key=lambda f: f.us_per_inference)[len(figures) // 2]


def row(figure: Figure) -> str:
    return (
        f"| {figure.label} | {figure.batch:.1f} | {figure.batches_per_s:.0f} | "
        f"{figure.us_per_inference:.1f} | {figure.us_per_batch:.0f} | "
        f"{figure.sleeps_per_batch:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window-s", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (median)")
    parser.add_argument(
        "--pairs", default="2,4,8", help="gateway and worker pairs at sluice's pace (comma list)"
    )
    args = parser.parse_args()
    measured: dict[str, list[Figure]] = {}
    for _ in range(args.rounds):
        reference = sluice_figure(args.window_s)
        batch, rate = max(1, round(reference.batch)), reference.batches_per_s
        patterns = [
            Pattern("bare wire, four events a batch, sluice's pace", False, rate),
            Pattern("bare wire, two events a batch, sluice's pace", True, rate),
            Pattern(
                "bare wire, two events a batch, 64 B a request, sluice's pace", True, rate, 0, 64
            ),
            Pattern("bare wire, two events a batch, unpaced", True, 0.0),
            Pattern("bare wire, two events a batch of 64, unpaced", True, 0.0, batch=64),
            *(
                Pattern(
                    f"bare wire, two events a batch, sluice's pace, {n} pairs", True, rate, pairs=n
                )
                for n in (int(n) for n in args.pairs.split(",") if n)
            ),
        ]
        figures = [
            reference,
            *(run_pattern(p, p.batch or batch, args.window_s) for p in patterns),
        ]
        for figure in figures:
            print(row(figure), flush=True)
            measured.setdefault(figure.label, []).append(figure)
    print(
        f"\n{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}, {Path(redis_server_binary()).name}; loopback TCP; median "
        f"of {args.rounds} rounds, {args.window_s} s windows"
    )
    print("| what | batch | batches/s | Redis µs/inference | Redis µs/batch | sleeps/batch |")
    print("|---|---|---|---|---|---|")
    for figures in measured.values():
        print(row(median(figures)))


if __name__ == "__main__":
    main()
