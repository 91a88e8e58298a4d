"""`sluice tune`'s decisions, without a server: the search path, the budget, the state file,
the candidates' configs and the report. Outcomes come from a model of a server's response
to each knob; time from a fake clock."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

from sluice.shared.model_config import load_model_config

from sluice.tune import state
from sluice.tune.candidates import Candidate, apply, pbtxt, start_of
from sluice.tune.report import cost_per_million, pareto, table, write_plot
from sluice.tune.search import (
    Axis,
    Level,
    Objective,
    Outcome,
    Search,
    best,
    run_search,
)

OBJECTIVE = Objective(p99_ms=10.0)
AXES = (
    Axis("max_batch_size", (1, 2, 4, 8, 16, 32, 64), ordered=True),
    Axis("delay_us", (0, 100, 500, 1000, 2000, 5000), ordered=True),
    Axis("instances", (1, 2, 4), ordered=True),
    Axis("batch_delay", ("fixed", "adaptive"), ordered=False),
    Axis("preferred", ("none", "max"), ordered=False),
)
START = Candidate(64, 1000, 1, "fixed", "none")


def modelled(c: Candidate) -> Outcome:
    """A server whose throughput peaks at batch 16, delay 500 µs, two instances, adaptive;
    batches past 32 break the p99 objective."""
    throughput = 1000.0 - 10 * abs(c.max_batch_size.bit_length() - 5) ** 2
    throughput -= abs(c.delay_us - 500) / 20 + 50 * abs(c.instances - 2)
    throughput += 30 if c.batch_delay == "adaptive" else 0
    p99_ms = 12.0 if c.max_batch_size > 32 else 5.0
    return Outcome((Level(8, throughput, p99_ms, 0),), seconds=10.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def searched(deadline: float) -> tuple[Search, FakeClock]:
    clock = FakeClock()
    search = Search(START, AXES, OBJECTIVE)

    async def measure(candidate: Candidate, until: float) -> Outcome:
        clock.now += 10.0
        return modelled(candidate)

    asyncio.run(run_search(search, measure, clock, deadline, lambda c, o: None))
    return search, clock


def grid() -> list[Candidate]:
    values = [axis.values for axis in AXES]
    return [Candidate(*combo) for combo in itertools.product(*values)]


def test_the_search_finds_the_grids_best_with_far_fewer_measurements() -> None:
    search, _ = searched(deadline=1e9)
    everything = {c: modelled(c) for c in grid()}
    assert best(search.outcomes, OBJECTIVE) == best(everything, OBJECTIVE)
    assert best(search.outcomes, OBJECTIVE) == Candidate(16, 500, 2, "adaptive", "none")
    assert len(search.outcomes) < len(everything) / 8


def test_a_lucky_measurement_is_measured_again_and_the_climb_goes_on() -> None:
    lucky = Candidate(32, 1000, 1, "fixed", "none")
    seen: list[Candidate] = []
    search = Search(START, AXES, OBJECTIVE)

    async def measure(candidate: Candidate, until: float) -> Outcome:
        seen.append(candidate)
        if candidate == lucky and seen.count(lucky) == 1:  # a fluke: twice its real figure
            return Outcome((Level(8, 2000.0, 5.0, 0),), 10.0)
        return modelled(candidate)

    asyncio.run(run_search(search, measure, FakeClock(), 1e9, lambda c, o: None))
    assert seen.count(lucky) == 2
    assert search.outcomes[lucky] == Outcome(modelled(lucky).levels, 20.0, runs=2)
    assert best(search.outcomes, OBJECTIVE) == Candidate(16, 500, 2, "adaptive", "none")
    assert search.outcomes[Candidate(16, 500, 2, "adaptive", "none")].runs == 2


def test_the_search_stops_before_a_candidate_would_overrun_the_budget() -> None:
    search, clock = searched(deadline=45.0)
    # each candidate takes 10 s: four fit, a fifth would end at 50 s
    assert len(search.outcomes) == 4
    assert clock.now == 40.0


def test_a_candidate_the_measurer_cannot_fit_ends_the_search() -> None:
    search = Search(START, AXES, OBJECTIVE)

    async def nothing_fits(candidate: Candidate, until: float) -> None:
        return None

    asyncio.run(run_search(search, nothing_fits, FakeClock(), 100.0, lambda c, o: None))
    assert search.outcomes == {}


def test_a_resumed_search_measures_only_what_the_first_run_did_not(tmp_path: Path) -> None:
    path = tmp_path / "state.jsonl"
    first, _ = searched(deadline=45.0)
    for candidate, outcome in first.outcomes.items():
        state.append(path, "key", candidate, outcome)
    resumed = Search(START, AXES, OBJECTIVE, state.load(path, "key", OBJECTIVE))
    assert resumed.outcomes == first.outcomes
    measured = []

    async def measure(candidate: Candidate, until: float) -> Outcome:
        measured.append(candidate)
        return modelled(candidate)

    asyncio.run(run_search(resumed, measure, FakeClock(), 1e9, lambda c, o: None))
    full, _ = searched(deadline=1e9)
    assert measured[0] not in first.outcomes  # the climb goes on where the first run stopped
    assert resumed.outcomes == full.outcomes


def test_state_of_other_settings_and_torn_lines_are_not_reused(tmp_path: Path) -> None:
    path = tmp_path / "state.jsonl"
    outcome = Outcome((Level(1, 0.0, float("inf"), 3),), 1.0)
    state.append(path, "other", START, outcome)
    state.append(path, "key", START, outcome)
    with path.open("ab") as file:
        file.write(b'{"key": "key", "candid')
    assert state.load(path, "other", OBJECTIVE) == {START: outcome}  # no answer: p99 infinite
    assert state.load(path, "key", OBJECTIVE) == {START: outcome}
    assert state.load(path, "new", OBJECTIVE) == {}
    better = Outcome((Level(1, 50.0, 2.0, 0),), 2.0)
    state.append(path, "key", START, better)  # measured again: the worse of the two counts
    assert state.load(path, "key", OBJECTIVE) == {START: Outcome(outcome.levels, 3.0, runs=2)}
    assert state.fingerprint({"p99_ms": 10}) != state.fingerprint({"p99_ms": 20})


def test_a_candidate_missing_the_p99_ranks_by_its_lowest_latency() -> None:
    slow = Outcome((Level(1, 500.0, 30.0, 0),), 1.0)
    slower = Outcome((Level(1, 900.0, 50.0, 0),), 1.0)
    met = Outcome((Level(1, 100.0, 5.0, 0), Level(2, 150.0, 20.0, 0)), 1.0)
    assert met.at_objective(OBJECTIVE) == Level(1, 100.0, 5.0, 0)
    a, b, c = START, START.with_value("instances", 2), START.with_value("instances", 4)
    assert best({a: slower, b: slow}, OBJECTIVE) == b
    assert best({a: slower, b: slow, c: met}, OBJECTIVE) == c
    assert not Outcome(met.levels, 1.0).meets(Objective(10.0, min_throughput=200.0))


def test_candidate_configs_load_as_the_model_config_parser_reads_them(tmp_path: Path) -> None:
    base = {
        "name": "m",
        "backend": "pytorch",
        "max_batch_size": 8,
        "input": [{"name": "INPUT__0", "data_type": "TYPE_FP32", "dims": ["4"]}],
        "output": [{"name": "OUTPUT__0", "data_type": "TYPE_FP32", "dims": ["4"]}],
        "dynamic_batching": {"max_queue_delay_microseconds": "100"},
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
    }
    assert start_of(base) == Candidate(8, 100, 1, "fixed", "none")
    candidate = Candidate(4, 2000, 2, "adaptive", "max")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text(pbtxt(apply(base, candidate)))
    spec = load_model_config(tmp_path / "m")
    assert spec.max_batch_size == 4
    assert spec.batching.max_queue_delay_us == 2000
    assert spec.batching.preferred_batch_sizes == (4,)
    assert spec.batching.delay_mode == "adaptive"
    assert spec.instance_count == 2
    assert start_of(apply(base, candidate)) == candidate


def test_the_report_prices_each_candidate_and_marks_the_front(tmp_path: Path) -> None:
    # $2/h for 3 workers serving 1,000/s: $6 per 3.6M inferences
    assert abs(cost_per_million(2.0, 3, 1000.0) - 6 / 3.6) < 1e-9
    fast, lean = START, START.with_value("instances", 2)
    dominated = START.with_value("instances", 4)
    outcomes = {
        fast: Outcome((Level(8, 1000.0, 9.0, 0),), 1.0),
        lean: Outcome((Level(2, 400.0, 2.0, 0),), 1.0),
        dominated: Outcome((Level(2, 300.0, 3.0, 0),), 1.0),
    }
    assert sorted(pareto(outcomes, OBJECTIVE)) == sorted([fast, lean])
    text = table(outcomes, OBJECTIVE, fast, price_per_hour=2.0, workers=3)
    rows = text.splitlines()
    assert "$/M infer" in rows[0]
    assert rows[1].startswith("*mbs 64") and rows[1].endswith(f"{6 / 3.6:.4f}")
    assert "$/M" not in table(outcomes, OBJECTIVE, fast, price_per_hour=None, workers=1)
    png = tmp_path / "pareto.png"
    assert write_plot(outcomes, OBJECTIVE, fast, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
