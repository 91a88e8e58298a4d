"""Which candidate to measure next, and the loop that measures within a time budget.

The search is coordinate hill-climbing from the model's current config: along each axis in
turn it measures the neighbours of the best candidate so far (the adjacent values of an
ordered axis, every value of an unordered one) and moves while a neighbour scores better;
it stops after a pass over every axis that moved nothing. It measures a few candidates per
axis where a grid measures the product of all axes. One measurement can be lucky, so the
best few are then measured again and each keeps its worse measurement; where that demotes
the best, the climb goes on from the new one. `next_candidate` is a pure function of the
outcomes so far, so a resumed run replays the same path from its saved outcomes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.tune.candidates import Candidate


@dataclass(frozen=True, slots=True)
class Level:
    """One concurrency of a candidate's ramp."""

    concurrency: int
    throughput: float
    p99_ms: float
    errors: int


@dataclass(frozen=True, slots=True)
class Objective:
    p99_ms: float
    min_throughput: float = 0.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """A candidate's ramp, and how long measuring it took (reload included)."""

    levels: tuple[Level, ...]
    seconds: float
    #: how many times the candidate was measured (this outcome is the worst of them)
    runs: int = 1

    def at_objective(self, objective: Objective) -> Level | None:
        """The level with the most throughput whose p99 meets the objective, error-free."""
        good = [lv for lv in self.levels if lv.p99_ms <= objective.p99_ms and lv.errors == 0]
        return max(good, key=lambda lv: lv.throughput, default=None)

    def meets(self, objective: Objective) -> bool:
        level = self.at_objective(objective)
        return level is not None and level.throughput >= objective.min_throughput

    def score(self, objective: Objective) -> tuple[bool, float]:
        """Meeting the objective first, then throughput at it; a candidate that never meets
        the p99 ranks by its lowest p99, so the search walks towards lower latency."""
        level = self.at_objective(objective)
        if level is not None:
            return self.meets(objective), level.throughput
        return False, -min((lv.p99_ms for lv in self.levels), default=float("inf"))


@dataclass(frozen=True, slots=True)
class Axis:
    name: str
    values: tuple[Any, ...]
    #: adjacent values are neighbours (a number); else every value is
    ordered: bool

    def neighbours(self, value: Any) -> tuple[Any, ...]:
        if not self.ordered:
            return tuple(v for v in self.values if v != value)
        i = self.values.index(value)
        return tuple(self.values[j] for j in (i - 1, i + 1) if 0 <= j < len(self.values))


Outcomes = Mapping[Candidate, Outcome]
#: passes over every axis at most (a pass that moves nothing ends the search sooner)
MAX_PASSES = 3
#: the best this many candidates are measured twice before the search ends
CONFIRMED = 3


def worse(a: Outcome, b: Outcome, objective: Objective) -> Outcome:
    """Two measurements of one candidate as one: the lower-scoring, counting both runs."""
    low = min(a, b, key=lambda o: o.score(objective))
    return Outcome(low.levels, a.seconds + b.seconds, a.runs + b.runs)


def best(outcomes: Outcomes, objective: Objective) -> Candidate | None:
    """The measured candidate that scores highest (fewer instances, then smaller batches on a
    tie, for their lower cost in memory)."""
    return max(outcomes, key=lambda c: _rank(c, outcomes, objective), default=None)


def _rank(c: Candidate, outcomes: Outcomes, objective: Objective) -> tuple[bool, float, int, int]:
    return (*outcomes[c].score(objective), -c.instances, -c.max_batch_size)


def _climb(
    at: Candidate, axis: Axis, outcomes: Outcomes, objective: Objective
) -> tuple[Candidate, Candidate | None]:
    """(the best along `axis` from `at`, a neighbour to measure first or None)."""
    while True:
        neighbours = [at.with_value(axis.name, v) for v in axis.neighbours(getattr(at, axis.name))]
        unmeasured = [c for c in neighbours if c not in outcomes]
        if unmeasured:
            return at, unmeasured[0]
        top = best({c: outcomes[c] for c in (at, *neighbours)}, objective)
        if top is None or top == at:
            return at, None
        at = top


def next_candidate(
    start: Candidate, axes: tuple[Axis, ...], outcomes: Outcomes, objective: Objective
) -> Candidate | None:
    """The next candidate to measure, or None when the search is over."""
    if start not in outcomes:
        return start
    at = start
    for _ in range(MAX_PASSES):
        before = at
        for axis in axes:
            at, todo = _climb(at, axis, outcomes, objective)
            if todo is not None:
                return todo
        if at == before:
            break
    return _to_confirm(outcomes, objective)


def _to_confirm(outcomes: Outcomes, objective: Objective) -> Candidate | None:
    """The best-ranked of the top candidates measured only once."""
    ranked = sorted(outcomes, key=lambda c: _rank(c, outcomes, objective), reverse=True)
    return next((c for c in ranked[:CONFIRMED] if outcomes[c].runs < 2), None)


Measure = Callable[[Candidate, float], Awaitable[Outcome | None]]


@dataclass(slots=True)
class Search:
    """One run: where it starts, what it may change, and what it measured."""

    start: Candidate
    axes: tuple[Axis, ...]
    objective: Objective
    #: outcomes so far, those of an earlier run of the same settings included
    outcomes: dict[Candidate, Outcome] = field(default_factory=dict)


async def run_search(
    search: Search,
    measure: Measure,
    clock: Callable[[], float],
    deadline: float,
    on_outcome: Callable[[Candidate, Outcome], None],
) -> None:
    """Measure candidates until the search ends or the next would not finish by `deadline`
    (a clock() time), judged by the mean time this run's candidates took so far.
    `on_outcome` gets each measurement as taken (a second one of a candidate too).
    `measure(candidate, deadline)` returns None when not even one level fits."""
    spent: list[float] = []
    while candidate := next_candidate(search.start, search.axes, search.outcomes, search.objective):
        expected = sum(spent) / len(spent) if spent else 0.0
        if clock() + expected > deadline:
            return
        began = clock()
        outcome = await measure(candidate, deadline)
        if outcome is None:
            return
        spent.append(clock() - began)
        on_outcome(candidate, outcome)
        if candidate in search.outcomes:
            outcome = worse(search.outcomes[candidate], outcome, search.objective)
        search.outcomes[candidate] = outcome
