"""What a tune run shows: a table of candidates, a Pareto plot and the cost of each."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from sluice.tune.candidates import Candidate
from sluice.tune.search import Level, Objective, Outcome

Outcomes = Mapping[Candidate, Outcome]


def cost_per_million(price_per_hour: float, workers: int, throughput: float) -> float:
    """Dollars per million inferences: what the workers cost an hour over what they serve."""
    return price_per_hour * workers / (throughput * 3600) * 1e6


def shown_point(outcome: Outcome, objective: Objective) -> Level:
    """Where a candidate is drawn: its level at the objective, else its lowest p99."""
    at = outcome.at_objective(objective)
    return at if at is not None else min(outcome.levels, key=lambda lv: lv.p99_ms)


def pareto(outcomes: Outcomes, objective: Objective) -> list[Candidate]:
    """Candidates no other beats on both throughput and p99 (at their shown points)."""
    points = {c: shown_point(o, objective) for c, o in outcomes.items()}
    return [
        c
        for c, p in points.items()
        if not any(
            q.throughput >= p.throughput
            and q.p99_ms <= p.p99_ms
            and (q.throughput, q.p99_ms) != (p.throughput, p.p99_ms)
            for q in points.values()
        )
    ]


def table(
    outcomes: Outcomes,
    objective: Objective,
    pick: Candidate | None,
    price_per_hour: float | None,
    workers: int,
) -> str:
    """One row per candidate, best first."""
    header = f"{'candidate':<46} {'infer/s':>9} {'p99 ms':>8} {'conc':>5} {'meets':>5}"
    if price_per_hour is not None:
        header += f" {'$/M infer':>10}"
    lines = [header]
    ranked = sorted(outcomes, key=lambda c: outcomes[c].score(objective), reverse=True)
    for candidate in ranked:
        outcome = outcomes[candidate]
        at = outcome.at_objective(objective)
        mark = "*" if candidate == pick else " "
        if at is None:
            row = f"{mark}{candidate.label():<45} {'-':>9} {'-':>8} {'-':>5} {'no':>5}"
        else:
            meets = "yes" if outcome.meets(objective) else "no"
            row = (
                f"{mark}{candidate.label():<45} {at.throughput:>9.1f} {at.p99_ms:>8.2f} "
                f"{at.concurrency:>5} {meets:>5}"
            )
        if price_per_hour is not None:
            cost = (
                f"{cost_per_million(price_per_hour, workers, at.throughput):.4f}"
                if at is not None and at.throughput > 0
                else "-"
            )
            row += f" {cost:>10}"
        lines.append(row)
    return "\n".join(lines)


def write_plot(
    outcomes: Outcomes, objective: Objective, pick: Candidate | None, path: Path
) -> bool:
    """Throughput against p99 for every candidate, the objective and the Pareto front drawn.

    Returns False, writing nothing, when matplotlib is not installed (it is optional).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = {c: shown_point(o, objective) for c, o in outcomes.items()}
    finite = {c: p for c, p in points.items() if p.p99_ms != float("inf")}
    ax.scatter(
        [p.throughput for p in finite.values()],
        [p.p99_ms for p in finite.values()],
        color="grey",
        label="candidates",
    )
    front = sorted(
        (finite[c] for c in pareto(outcomes, objective) if c in finite), key=lambda p: p.throughput
    )
    ax.plot([p.throughput for p in front], [p.p99_ms for p in front], "o-", label="Pareto front")
    if pick is not None and pick in finite:
        chosen = finite[pick]
        ax.scatter(
            [chosen.throughput],
            [chosen.p99_ms],
            marker="*",
            s=250,
            color="red",
            label="pick",
            zorder=3,
        )
    ax.axhline(objective.p99_ms, color="red", linestyle="--", label=f"p99 {objective.p99_ms:g} ms")
    if objective.min_throughput:
        ax.axvline(
            objective.min_throughput, color="orange", linestyle="--", label="throughput floor"
        )
    ax.set(
        xlabel="throughput at objective (infer/s)", ylabel="p99 latency (ms)", title="sluice tune"
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
