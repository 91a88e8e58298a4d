"""What the fleet-wide statistics cost: the same per-batch ack call with and without them.

Workers log each batch's statistics in the Lua call that acks the batch, so metrics add no
round trip; this measures what they do add: Redis CPU per call (INFO commandstats, folding
the log into the hash every few calls included) and the worker's Python time to build the
record, then relates it to a throughput and batch size.

    python benchmarks/metrics_cost.py [--throughput 2046 --batch 39.5]
"""

from __future__ import annotations

import argparse
import time

import redis
from sluice.shared import keys
from sluice.shared.stats import FINISH_BATCH, BatchStats, stats_record

from sluice.embedded_redis import EmbeddedRedis

CALLS = 5000


def batch_stats(size: int) -> BatchStats:
    stats = BatchStats(1, size, int(time.time() * 1000), requests_ok=size)
    stats.queue_samples_ns = [1_500_000 + 10_000 * i for i in range(size)]
    stats.request_samples_ns = [9_000_000 + 10_000 * i for i in range(size)]
    stats.input_ns, stats.infer_ns, stats.output_ns = 200_000, 9_000_000, 150_000
    return stats


def redis_us_per_call(client: redis.Redis, with_stats: bool, size: int) -> float:
    client.config_resetstat()
    stream = keys.request_stream("bench")
    record = [stats_record(batch_stats(size).increments())] if with_stats else []
    script_keys = [stream, keys.model_stats("bench"), keys.queue_sizes("bench")]
    for _ in range(CALLS):
        FINISH_BATCH.run(
            client,
            [*script_keys, keys.model_stats_log("bench")],
            [keys.WORKER_GROUP, 0, 0, 0, *record],
        )
    stats = client.info("commandstats")
    return float(stats["cmdstat_eval"]["usec_per_call"])


def python_us_per_batch(size: int) -> float:
    stats = batch_stats(size)
    start_s = time.perf_counter()
    for _ in range(CALLS):
        stats_record(stats.increments())
    return (time.perf_counter() - start_s) / CALLS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--throughput", type=float, default=2046.0, help="inferences/s")
    parser.add_argument("--batch", type=float, default=39.5, help="average batch size")
    args = parser.parse_args()
    size = round(args.batch)
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        bare = redis_us_per_call(client, False, size)
        full = redis_us_per_call(client, True, size)
    build = python_us_per_batch(size)
    batches_per_s = args.throughput / args.batch
    per_second_us = batches_per_s * ((full - bare) + build)
    print(f"Redis CPU per ack call: {bare:.1f} µs without statistics, {full:.1f} µs with")
    print(f"worker Python time to build a batch's increments: {build:.1f} µs")
    print(
        f"at {args.throughput:,.0f} infer/s in batches of {args.batch}: "
        f"{per_second_us / 1000:.2f} ms of CPU per second "
        f"= {per_second_us / 1e4:.2f} % of one core"
    )


if __name__ == "__main__":
    main()
