"""The soak's closing summary: counts, latencies, memory and what the serve log said."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import TYPE_CHECKING, Any

from soak_tally import Chaos, Tally

if TYPE_CHECKING:
    from soak_processes import Serve


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} MiB"


def _memory_lines(label: str, snap: dict[str, Any] | None) -> list[str]:
    if snap is None:
        return [f"  {label}: not taken"]
    used = snap["redis_used"]
    workers = ", ".join(f"{pid}: {_mib(rss)}" for pid, rss in snap["workers"].items()) or "none"
    return [
        f"  {label}: Redis used_memory {_mib(used / 2**20 if used is not None else None)}; "
        f"gateway (serve) RSS {_mib(snap['gateway'])}; workers RSS {workers}"
    ]


def _lost_timeline(tally: Tally, chaos: Chaos, limit: int = 12) -> list[str]:
    """When each lost request was sent, and the chaos event just before it."""
    if not tally.lost_log:
        return []
    lines = [f"lost requests (first {limit}), seconds after the start of the chaos phase:"]
    for sent_s, request_id, _why in sorted(tally.lost_log)[:limit]:
        before = [(at_s, what) for at_s, what in chaos.events if at_s <= sent_s]
        last = f"{before[-1][1]} at {before[-1][0]:.2f} s" if before else "no chaos yet"
        lines.append(f"  {request_id} sent at {sent_s:.2f} s; last event before: {last}")
    return lines


def summary(
    args: argparse.Namespace,
    tally: Tally,
    chaos: Chaos,
    elapsed_s: float,
    report: dict[str, Any],
    serve: Serve,
) -> list[str]:
    lost, wrong = sum(tally.lost.values()), sum(tally.wrong.values())
    latencies_s = sorted(tally.latencies_s)

    def pct(q: float) -> str:
        if not latencies_s:
            return "-"
        return f"{latencies_s[min(len(latencies_s) - 1, int(q * len(latencies_s)))] * 1000:.1f} ms"

    restarts_seen = sum("restarting" in line for line in serve.log)
    warm = min(args.warmup, args.requests)
    answered = tally.done - warm - lost
    busy_s = max(tally.last_answer_s - tally.t0_s, 1e-9)
    rows = [
        ("sent", tally.sent),
        ("ok", tally.ok),
        ("clear errors", sum(tally.clear.values())),
        ("lost", lost),
        ("duplicated/wrong", wrong),
        ("workers killed", chaos.kills),
        ("worker restarts logged by serve", restarts_seen),
        ("Redis restarts", chaos.redis_restarts),
        ("elapsed (after warm-up)", f"{elapsed_s:.1f} s"),
        ("throughput (answers/s)", f"{(tally.done - warm) / elapsed_s:.1f}"),
        (
            "  not counting waits for lost",
            f"{answered / busy_s:.1f} (last answer at {busy_s:.1f} s)",
        ),
        ("latency p50 / p99 / max", f"{pct(0.5)} / {pct(0.99)} / {pct(1.0)}"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = ["", "=" * 72, "sluice soak summary", "=" * 72]
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    for title, counts in (("clear errors", tally.clear), ("lost", tally.lost)):
        for key, n in counts.most_common():
            where = f"HTTP {key[0]} {key[1]!r}" if isinstance(key, tuple) else key
            lines.append(f"  {title}: {n:>6} x {where}")
    for kind, n in tally.wrong.most_common():
        lines.append(f"  duplicated/wrong: {n:>6} x {kind}")
    lines += _lost_timeline(tally, chaos)
    lines.append("memory:")
    lines += _memory_lines("after warm-up", report.get("warm"))
    lines += _memory_lines("at the end   ", report.get("end"))
    if chaos.redis_restarts:
        lines.append(f"  Redis restart took {chaos.redis_restart_s:.2f} s")
    lines += _log_digest(serve.log)
    lines.append("=" * 72)
    return lines


def _log_digest(log: list[str], limit: int = 8) -> list[str]:
    """How many warnings and errors serve logged, and the distinct error messages."""
    warnings = sum(" WARNING " in line for line in log)
    errors = [line for line in log if " ERROR " in line or line.startswith("ERROR:")]
    lines = [f"serve log: {len(log)} lines, {warnings} warnings, {len(errors)} errors"]
    distinct = Counter(line.split("]: ", 1)[-1][:110] for line in errors)
    lines += [f"  {n:>5} x {message}" for message, n in distinct.most_common(limit)]
    return lines
