"""The chaos scenario: a fixed number of requests from client threads, each thread with its own
keep-alive connection, while faults strike at set fractions of the run; every answer is checked.

Used by tests/test_chaos.py and benchmarks/chaos.py. Requests go to the `affine` model of
tests/model_repo (y = 2x + 1); each carries its own id and values, so a wrong, missing or
repeated answer is seen.
"""

from __future__ import annotations

import http.client
import itertools
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from sluice.shared import keys
from sluice.shared.redis_client import sync_client
from sluice.shared.registry import live_members, now_ms

MODEL = "affine"
Fault = tuple[float, str, Callable[[], None]]


@dataclass(slots=True)
class Outcome:
    status: int
    latency_s: float
    finished_at: float
    #: why the answer is not the expected one (None: correct, or a non-200 status).
    wrong: str | None = None


@dataclass
class Figures:
    total: int
    outcomes: dict[int, Outcome]
    #: requests that got no HTTP answer at all (connection dropped, client timeout).
    lost: list[int]
    #: ids answered more than once.
    duplicated: list[int]
    #: when each fault struck, seconds from the start.
    faults: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return sum(o.status == 200 and o.wrong is None for o in self.outcomes.values())

    @property
    def wrong(self) -> list[int]:
        return [i for i, o in self.outcomes.items() if o.wrong is not None]

    def statuses(self) -> Counter[int]:
        return Counter(o.status for o in self.outcomes.values())

    def latency_ms(self, quantile: float) -> float:
        times = sorted(o.latency_s for o in self.outcomes.values() if o.status == 200)
        if not times:
            return float("nan")
        return 1000 * times[min(len(times) - 1, int(quantile * len(times)))]

    def longest_stall_s(self) -> float:
        """The longest time without any answer: what the clients saw of the outages."""
        ends = sorted(o.finished_at for o in self.outcomes.values())
        return max((b - a for a, b in itertools.pairwise(ends)), default=0.0)

    def report(self) -> str:
        lines = [
            f"requests {self.total}: answered 200 {self.ok} ({100 * self.ok / self.total:.2f} %),"
            f" lost {len(self.lost)}, wrong {len(self.wrong)},"
            f" duplicated {len(self.duplicated)}",
            f"statuses {dict(sorted(self.statuses().items()))}",
            f"latency of 200s: p50 {self.latency_ms(0.5):.1f} ms,"
            f" p99 {self.latency_ms(0.99):.1f} ms, max {self.latency_ms(1.0):.1f} ms",
            f"longest time without an answer: {self.longest_stall_s():.2f} s",
            "faults at: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.faults.items()),
        ]
        return "\n".join(lines)


def _body(index: int) -> tuple[bytes, list[float]]:
    x = [index * 4 + k + 0.5 for k in range(4)]  # never 13, which the model refuses
    body = {
        "id": str(index),
        "inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": x}],
    }
    return orjson.dumps(body), [2 * v + 1 for v in x]


def _check(index: int, payload: bytes, expected: list[float]) -> str | None:
    try:
        answer = orjson.loads(payload)
        got = answer["outputs"][0]["data"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return f"unreadable answer {payload[:200]!r}"
    if answer.get("id") != str(index):
        return f"answer for id {answer.get('id')!r}"
    if got != expected:
        return f"values {got} instead of {expected}"
    return None


class ChaosLoad:
    """`total` requests from `concurrency` threads; `wait_for(n)` returns once n have ended."""

    def __init__(self, address: str, total: int, concurrency: int, timeout_s: float = 60.0):
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        self.total = total
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.outcomes: dict[int, Outcome] = {}
        self.lost: list[int] = []
        self.duplicated: list[int] = []
        self.started = time.monotonic()
        self._next = 0
        self._ended = 0
        self._progress = threading.Condition()
        self._threads = [threading.Thread(target=self._client) for _ in range(concurrency)]

    def start(self) -> None:
        self.started = time.monotonic()
        for thread in self._threads:
            thread.start()

    def _take(self) -> int | None:
        with self._progress:
            if self._next >= self.total:
                return None
            self._next += 1
            return self._next - 1

    def _end(self, index: int, outcome: Outcome | None) -> None:
        with self._progress:
            if outcome is None:
                self.lost.append(index)
            elif index in self.outcomes:
                self.duplicated.append(index)
            else:
                self.outcomes[index] = outcome
            self._ended += 1
            self._progress.notify_all()

    def _client(self) -> None:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        path = f"/v2/models/{MODEL}/infer"
        headers = {"Content-Type": "application/json"}
        while (index := self._take()) is not None:
            body, expected = _body(index)
            sent = time.monotonic()
            try:
                connection.request("POST", path, body, headers)
                response = connection.getresponse()
                payload = response.read()
            except (OSError, http.client.HTTPException):
                connection.close()
                self._end(index, None)
                continue
            now = time.monotonic()
            wrong = _check(index, payload, expected) if response.status == 200 else None
            self._end(index, Outcome(response.status, now - sent, now - self.started, wrong))
        connection.close()

    def wait_for(self, ended: int, timeout_s: float = 300.0) -> None:
        with self._progress:
            if not self._progress.wait_for(lambda: self._ended >= ended, timeout_s):
                raise AssertionError(f"only {self._ended} of {ended} requests ended in time")

    def join(self, timeout_s: float = 300.0) -> None:
        self.wait_for(self.total, timeout_s)
        for thread in self._threads:
            thread.join(timeout_s)


def run_chaos(
    address: str, total: int, concurrency: int, faults: list[Fault], timeout_s: float = 60.0
) -> Figures:
    """Send the load; strike each (fraction, name, fault) once that share of requests ended."""
    load = ChaosLoad(address, total, concurrency, timeout_s)
    load.start()
    struck: dict[str, float] = {}
    for fraction, name, fault in sorted(faults, key=lambda f: f[0]):
        load.wait_for(int(fraction * total))
        struck[name] = time.monotonic() - load.started
        fault()
    load.join()
    return Figures(total, load.outcomes, load.lost, load.duplicated, struck)


def kill_a_worker(redis_url: str) -> Callable[[], None]:
    """A fault: SIGKILL one live worker of the fleet (its pid from its heartbeat)."""

    def kill() -> None:
        client = sync_client(redis_url)
        try:
            members, _ = live_members(client.hgetall(keys.FLEET), now_ms())
        finally:
            client.close()
        workers = sorted(m.pid for m in members if m.kind == "worker")
        if not workers:
            raise AssertionError("no live worker to kill")
        os.kill(workers[0], signal.SIGKILL)

    return kill
