"""A model's streams split into partitions: keys on separate slots (shards of the cluster run),
entries dealt to every partition, workers reading all of them into full batches, statistics
summed, and a worker killed under load losing nothing."""

from __future__ import annotations

import signal
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from redis.crc import key_slot
from sluice.shared import keys
from sluice.shared.errors import ModelConfigError
from sluice.shared.model_config import load_model_config
from sluice.shared.partitions import Dealer, config_partitions, share
from sluice.shared.redis_client import sync_client
from sluice.shared.registry import live_members, now_ms
from sluice.shared.stats import merged_stats_hash

from tests.conftest import ON_CLUSTER, Service, serving_alone, wait_until
from tests.streams import start_worker, write_python_model

PARTITIONS = 3
#: three partitions whose hash tags fall in the three thirds of the slots (three shards).
MODEL = "hot"
CONFIG = f"""
name: "{MODEL}"
backend: "python"
max_batch_size: 8
input [ {{ name: "IN", data_type: TYPE_INT64, dims: [ 1 ] }} ]
output [
  {{ name: "OUT", data_type: TYPE_INT64, dims: [ 1 ] }},
  {{ name: "ROWS", data_type: TYPE_INT64, dims: [ 1 ] }}
]
dynamic_batching {{ max_queue_delay_microseconds: 20000 }}
parameters {{ key: "PARTITIONS" value: {{ string_value: "{PARTITIONS}" }} }}
"""
ROWS_MODEL = textwrap.dedent("""
    import numpy as np


    class Model:
        def __init__(self, context):
            pass

        def infer(self, inputs):
            rows = len(inputs["IN"])
            return {"OUT": inputs["IN"] + 1, "ROWS": np.full((rows, 1), rows, np.int64)}
""")
RECOVERY = ("--claim-idle-ms", "600")


def test_partition_keys_share_a_slot_within_a_partition_and_differ_across() -> None:
    for partition in range(PARTITIONS):
        stream = keys.request_stream(MODEL, 2, partition)
        assert keys.partition_of(stream) == partition
        siblings = [
            stream,
            keys.request_stream(MODEL, 0, partition),
            keys.queue_sizes(MODEL, partition),
            keys.model_stats(MODEL, partition),
            keys.model_stats_log(MODEL, partition),
        ]
        assert len({key_slot(k.encode()) for k in siblings}) == 1
    assert keys.request_stream(MODEL) == f"sluice:{{m:{MODEL}}}:requests"  # as before
    slots = [key_slot(keys.request_stream(MODEL, 0, p).encode()) for p in range(PARTITIONS)]
    assert sorted(s * 3 // 16384 for s in slots) == [0, 1, 2]


def test_entries_are_dealt_in_turn_per_model_and_level() -> None:
    dealer = Dealer()
    assert [dealer.next("a", 0, 3) for _ in range(4)] == [0, 1, 2, 0]
    assert [dealer.next("a", 1, 3), dealer.next("b", 0, 2), dealer.next("a", 0, 3)] == [0, 0, 1]
    assert dealer.next("c", 0, 1) == 0
    assert [share(10, 3), share(0, 3), share(4, 1)] == [4, 0, 4]


def test_a_partition_more_than_a_batch_behind_is_passed_over() -> None:
    dealer = Dealer()
    dealer.observe("a", 0, [3, 20, 10], batch=8)  # partition 1: a slow shard
    assert [dealer.next("a", 0, 3) for _ in range(4)] == [0, 2, 0, 2]
    assert dealer.next("a", 1, 3) == 0  # other levels are dealt as before
    dealer.observe("a", 0, [3, 11, 10], batch=8)  # caught up
    assert sorted(dealer.next("a", 0, 3) for _ in range(3)) == [0, 1, 2]


def test_the_partitions_parameter_is_checked(tmp_path: Path) -> None:
    for bad, why in (("0", "between 1 and 64"), ("x", "must be an integer"), ("65", "65")):
        repo = tmp_path / bad
        write_python_model(repo, MODEL, CONFIG.replace(f'"{PARTITIONS}"', f'"{bad}"'), ROWS_MODEL)
        with pytest.raises(ModelConfigError, match=rf"parameters\.PARTITIONS: .*{why}"):
            load_model_config(repo / MODEL)
    spec = load_model_config(write_python_model(tmp_path / "ok", MODEL, CONFIG, "") / MODEL)
    assert spec.partitions == PARTITIONS == config_partitions(spec.config_json)
    assert config_partitions({"name": "plain"}) == 1


def test_statistics_of_partitions_sum() -> None:
    one = [b"1:inference_count", b"3", b"1:last_inference", b"100"]
    two = [b"1:inference_count", b"4", b"1:last_inference", b"90", b"reclaimed", b"1"]
    assert merged_stats_hash([one, two]) == {
        b"1:inference_count": b"7",
        b"1:last_inference": b"100",
        b"reclaimed": b"1",
    }


#: the same model with two priority levels, each with a queue-size limit.
LEVELS_MODEL = "hot_levels"
LEVELS_CONFIG = CONFIG.replace(f'name: "{MODEL}"', f'name: "{LEVELS_MODEL}"').replace(
    "dynamic_batching { max_queue_delay_microseconds: 20000 }",
    "dynamic_batching { max_queue_delay_microseconds: 20000 priority_levels: 2 "
    "default_priority_level: 2 default_queue_policy { max_queue_size: 1000 } }",
)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    repo = write_python_model(tmp_path_factory.mktemp("partitions"), MODEL, CONFIG, ROWS_MODEL)
    write_python_model(repo, LEVELS_MODEL, LEVELS_CONFIG, ROWS_MODEL)
    with serving_alone(repo) as served:
        served.repo = repo  # type: ignore[attr-defined]
        yield served


def _infer(url: str, value: int, model: str = MODEL, priority: int = 0) -> tuple[int, int]:
    with httpclient.InferenceServerClient(url) as client:
        tensor = httpclient.InferInput("IN", [1, 1], "INT64")
        tensor.set_data_from_numpy(np.array([[value]], np.int64))
        result = client.infer(model, [tensor], priority=priority)
        return int(result.as_numpy("OUT")[0, 0]), int(result.as_numpy("ROWS")[0, 0])


def _counted_and_back_to_zero(client: Any, key: str) -> bool:
    """Both levels were counted, and every request counted was answered."""
    sizes = client.hgetall(key)
    return len(sizes) == 2 and {int(v) for v in sizes.values()} == {0}


def _delivered(redis_url: str) -> list[bool]:
    """Whether each partition's stream has delivered entries to the workers."""
    client = sync_client(redis_url)
    try:
        return [
            any(
                g["last-delivered-id"] not in (b"0-0", "0-0")
                for g in client.xinfo_groups(keys.request_stream(MODEL, 0, partition))
            )
            for partition in range(PARTITIONS)
        ]
    finally:
        client.close()


def _load(url: str, clients: int, per_client: int, start: int) -> dict[int, tuple[int, int]]:
    def one_client(offset: int) -> list[tuple[int, tuple[int, int]]]:
        values = range(start + offset, start + clients * per_client, clients)
        return [(v, _infer(url, v)) for v in values]

    with ThreadPoolExecutor(clients) as pool:
        answers = [a for part in pool.map(one_client, range(clients)) for a in part]
    assert len(answers) == clients * per_client
    return dict(answers)


def test_every_partition_is_dealt_entries_and_read_into_batches(service: Service) -> None:
    answers = _load(service.http_url, 12, 10, 0)
    assert {v: out for v, (out, _) in answers.items()} == {v: v + 1 for v in range(120)}
    assert max(rows for _, rows in answers.values()) > 1  # batches across partitions
    assert all(_delivered(service.redis_url))

    def statistics() -> dict[str, Any]:
        with httpclient.InferenceServerClient(service.http_url) as client:
            stats: dict[str, Any] = client.get_inference_statistics(MODEL)["model_stats"][0]
            return stats

    # summed over the partitions' statistics (a batch's record is written just after its
    # replies, so the last one may land after its clients have their answers)
    wait_until(lambda: int(statistics()["inference_count"]) >= 120, "every inference counted")
    stats = statistics()
    assert int(stats["execution_count"]) < int(stats["inference_count"])


def test_priority_levels_and_queue_limits_work_per_partition(service: Service) -> None:
    """Each level of each partition is its own stream, read and counted: every request is
    answered, and every partition's queue-size counter of each level is back at 0."""

    def one(value: int) -> tuple[int, tuple[int, int]]:
        return value, _infer(service.http_url, value, LEVELS_MODEL, priority=1 + value % 2)

    with ThreadPoolExecutor(12) as pool:
        answers = dict(pool.map(one, range(96)))
    assert {v: out for v, (out, _) in answers.items()} == {v: v + 1 for v in range(96)}
    client = sync_client(service.redis_url)
    try:
        for partition in range(PARTITIONS):
            for level in (1, 2):
                stream = keys.request_stream(LEVELS_MODEL, level, partition)
                (group,) = client.xinfo_groups(stream)
                assert group["last-delivered-id"] not in (b"0-0", "0-0"), stream
            sizes = keys.queue_sizes(LEVELS_MODEL, partition)
            # lowered just after the replies are written, so maybe after the last answer
            wait_until(partial(_counted_and_back_to_zero, client, sizes), f"{sizes} at 0")
    finally:
        client.close()


@pytest.mark.skipif(not ON_CLUSTER, reason="shards exist on the cluster run")
def test_the_partitions_live_on_different_shards(service: Service) -> None:
    client = sync_client(service.redis_url)
    try:
        nodes = {
            client.get_node_from_key(keys.request_stream(MODEL, 0, p)).name
            for p in range(PARTITIONS)
        }
    finally:
        client.close()
    assert len(nodes) == PARTITIONS


def test_a_worker_killed_under_load_loses_nothing(service: Service) -> None:
    """Two more workers join; one is killed, while it holds entries, as 12 clients keep
    sending. Its entries, on any partition, are taken over; every request gets its one right
    answer, and batches stay full after the kill."""
    repo = service.repo  # type: ignore[attr-defined]
    doomed = start_worker(repo, service.redis_url, *RECOVERY)
    survivor = start_worker(repo, service.redis_url, *RECOVERY)
    stop = threading.Event()
    answers: list[tuple[int, tuple[int, int]]] = []

    def client_loop(value: int) -> None:
        while not stop.is_set():
            answers.append((value, _infer(service.http_url, value)))
            value += 12

    try:
        wait_until(lambda: _workers_serving(service.redis_url) == 3, "three workers")
        with ThreadPoolExecutor(12) as pool:
            loops = [pool.submit(client_loop, 1000 + i) for i in range(12)]
            try:
                wait_until(
                    lambda: _held(service.redis_url, doomed.pid), "entries held by the doomed"
                )
                doomed.send_signal(signal.SIGKILL)
                doomed.wait(30)
                killed_at = len(answers)
                wait_until(lambda: len(answers) >= killed_at + 120, "traffic after the kill")
            finally:
                stop.set()
            for loop in loops:
                loop.result()  # every request sent was answered, none failed
    finally:
        doomed.kill()
        survivor.terminate()
        assert survivor.wait(30) == 0
    values = [value for value, _ in answers]
    assert len(values) == len(set(values))  # one answer each
    assert all(out == value + 1 for value, (out, _) in answers)
    assert max(rows for _, (_, rows) in answers[killed_at:]) > 1


def _workers_serving(redis_url: str) -> int:
    client = sync_client(redis_url)
    try:
        members, _ = live_members(client.hgetall(keys.FLEET), now_ms())
    finally:
        client.close()
    return sum(
        1
        for m in members
        if m.kind == "worker" and MODEL in m.models and m.models[MODEL].ready_versions
    )


def _held(redis_url: str, pid: int) -> bool:
    """Whether the worker with process id `pid` holds entries it has not answered."""
    client = sync_client(redis_url)
    try:
        for partition in range(PARTITIONS):
            stream = keys.request_stream(MODEL, 0, partition)
            for consumer in client.xinfo_consumers(stream, keys.WORKER_GROUP):
                name = consumer["name"]
                name = name.decode() if isinstance(name, bytes) else name
                if f"-{pid}-" in name and consumer["pending"] > 0:
                    return True
        return False
    finally:
        client.close()
