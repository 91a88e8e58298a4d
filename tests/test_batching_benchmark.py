"""benchmarks/inflight_vs_batched.py's load and figures, on made-up records: never timings."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import inflight_vs_batched as bench


def test_every_rate_sends_the_same_requests_in_the_same_order() -> None:
    slow, fast = bench.plan(2.0, 30.0, 512), bench.plan(20.0, 30.0, 512)
    assert len(fast) > len(slow) > 0
    shared = len(slow)
    assert [(p.prompt, p.tokens) for p in fast[:shared]] == [(p.prompt, p.tokens) for p in slow]
    assert bench.plan(2.0, 30.0, 512) == slow  # seeded
    assert bench.plan(2.0, 30.0, 512, seed=1) != slow


def test_arrivals_and_lengths_keep_to_the_plan() -> None:
    load = bench.plan(200.0, 50.0, 512)
    times_s = [p.at_s for p in load]
    assert times_s == sorted(times_s) and times_s[0] >= 0 and times_s[-1] < 50.0
    assert len(load) == pytest.approx(200 * 50, rel=0.05)
    lengths = np.array([p.tokens for p in load])
    assert lengths.min() >= 1 and lengths.max() == 512
    # exponential with mean 128, capped at 512: 128 (1 - e^-4), plus the rounding up
    assert lengths.mean() == pytest.approx(128 * (1 - np.exp(-4)) + 0.5, rel=0.05)


def _record(
    at_s: float, tokens: int, sent_s: float, arrivals_s: list[float], done: bool
) -> bench.Record:
    return bench.Record(bench.Planned(at_s, "def ", tokens), sent_s, arrivals_s, done)


def test_figures_count_the_window_and_censor_waits() -> None:
    records = [
        _record(0.0, 3, 100.0, [100.5, 101.0, 103.0], True),  # whole
        _record(1.0, 4, 101.0, [101.5, 102.0], True),  # ended short
        _record(2.0, 5, 102.0, [], False),  # never started: waits until the end
    ]
    run = bench.Run(records, start_s=100.0, window_s=4.0, end_s=106.0)
    figures = run.figures()
    assert figures["requests"] == 3
    assert figures["completed"] == 1
    assert figures["wrong_length"] == 1
    assert figures["offered_tokens_per_s"] == pytest.approx(12 / 4.0)
    # the window is [start + 1, start + 4): the tokens at 101.0, 101.5, 102.0 and 103.0
    assert figures["tokens_per_s"] == pytest.approx(4 / 3.0)
    ttft_s = np.array([0.5, 0.5, 4.0])
    assert figures["ttft_p50_ms"] == pytest.approx(500.0)
    assert figures["ttft_p99_ms"] == pytest.approx(np.percentile(ttft_s, 99) * 1e3)
    assert figures["itl_p50_ms"] == pytest.approx(500.0)  # 0.5, 2.0 and 0.5 s


def _row(rate: float, offered: float, got: float) -> bench.Row:
    return {"rate": rate, "offered_tokens_per_s": offered, "tokens_per_s": got}


def test_saturation_is_the_highest_rate_served_and_capacity_the_most_tokens() -> None:
    rows = [_row(4, 500, 420), _row(6, 750, 760), _row(9, 1100, 900), _row(13, 1600, 950)]
    assert bench.saturation(rows)["rate"] == 6  # 4 fell short by chance: a later one served
    assert bench.capacity(rows)["rate"] == 13
    assert bench.saturation([_row(4, 500, 100)])["rate"] == 4  # none served: the first
