"""What a run shows: a progress line per window, a table, a JSON document and a plot."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from sluice.bench.loadgen import BenchResult, LevelResult
from sluice.bench.settings import BenchSettings, Mode
from sluice.bench.stats import Latency, Measurement

#: the client runs on one core; beyond this share of it, it may be what limits the load
CLIENT_BUSY = 0.8


def level_label(mode: Mode, level: float) -> str:
    return f"concurrency {level:g}" if mode == "concurrency" else f"rate {level:g}/s"


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f}"


def progress_line(mode: Mode, level: float, trial: int, max_trials: int, m: Measurement) -> str:
    latency = (
        f"p50 {_ms(m.latency.p50_us)} ms  p95 {_ms(m.latency.p95_us)} ms  "
        f"p99 {_ms(m.latency.p99_us)} ms"
        if m.latency
        else "no successful request"
    )
    batch = f"  avg batch {m.server.avg_batch:.1f}" if m.server else ""
    return (
        f"{level_label(mode, level)}  window {trial}/{max_trials}: {m.throughput:.1f} infer/s  "
        f"{latency}  errors {m.errors}{batch}  client cpu {m.client_cpu:.0%}"
    )


_COLUMNS = (
    ("infer/s", 9),
    ("p50 ms", 7),
    ("p90 ms", 7),
    ("p95 ms", 7),
    ("p99 ms", 7),
    ("avg ms", 7),
    ("errors", 6),
    ("queue µs", 9),
    ("input µs", 9),
    ("infer µs", 9),
    ("output µs", 9),
    ("avg batch", 9),
    ("client cpu", 10),
    ("stable", 6),
)


def _row(level: LevelResult) -> list[str]:
    m = level.result
    lat = m.latency
    latency = (
        [_ms(x) for x in (lat.p50_us, lat.p90_us, lat.p95_us, lat.p99_us, lat.avg_us)]
        if lat
        else ["-"] * 5
    )
    s = m.server
    server = (
        [f"{x:.0f}" for x in (s.queue_us, s.compute_input_us, s.compute_infer_us)]
        + [f"{s.compute_output_us:.0f}", f"{s.avg_batch:.2f}"]
        if s
        else ["-"] * 5
    )
    stable = "yes" if level.stable else "no"
    return [f"{m.throughput:.1f}", *latency, str(m.errors), *server, f"{m.client_cpu:.0%}", stable]


def batch_buckets(sizes: dict[int, int], up_to: int = 1) -> dict[str, int]:
    """Executions per power-of-two range of batch size (1, 2-3, 4-7, ...), up to the largest.

    Exact sizes are in the JSON; ranges keep the table and plot readable at any batch size.
    """
    top = max([*sizes, up_to])
    buckets: dict[str, int] = {}
    low = 1
    while low <= top:
        high = 2 * low - 1
        label = str(low) if low == high else f"{low}-{high}"
        buckets[label] = sum(n for size, n in sizes.items() if low <= size <= high)
        low *= 2
    return buckets


def table(result: BenchResult) -> str:
    """The final table: client view (throughput, latency) next to the server's split."""
    settings = result.settings
    first = "concurrency" if settings.mode == "concurrency" else "req/s"
    width = max(len(first), 11)
    header = first.ljust(width) + "".join(f"  {name:>{w}}" for name, w in _COLUMNS)
    lines = [header]
    for level in result.levels:
        cells = "".join(
            f"  {cell:>{w}}" for cell, (_, w) in zip(_row(level), _COLUMNS, strict=True)
        )
        lines.append(f"{level.level:<{width}g}{cells}")
    lines.append("")
    lines.append("executed batches by batch size:")
    for level in result.levels:
        s = level.result.server
        total = sum(s.batch_sizes.values()) if s else 0
        sizes = "  ".join(
            f"{label}: {n} ({n / total:.0%})"
            for label, n in batch_buckets(s.batch_sizes if s else {}).items()
            if n
        )
        lines.append(f"  {level_label(settings.mode, level.level)}: {sizes or 'n/a'}")
    busy = [lv for lv in result.levels if lv.result.client_cpu > CLIENT_BUSY]
    if busy:
        where = ", ".join(level_label(settings.mode, lv.level) for lv in busy)
        lines.append(
            f"note: the client used over {CLIENT_BUSY:.0%} of a core at {where}: "
            "it may be what limits the load there"
        )
    return "\n".join(lines)


def _settings_json(settings: BenchSettings) -> dict[str, Any]:
    """Everything that defines the run, but never the auth token."""
    return {
        "url": settings.target.authority,
        "model": settings.target.model,
        "mode": settings.mode,
        "levels": list(settings.levels),
        "distribution": settings.distribution,
        "batch_size": settings.batch_size,
        "input_data": settings.input_data,
        "binary": settings.binary,
        "window_ms": settings.window_s * 1e3,
        "stability_percent": settings.stability_percent,
        "max_trials": settings.max_trials,
        "warmup_s": settings.warmup_s,
    }


def _measurement_json(m: Measurement) -> dict[str, Any]:
    out = asdict(m)
    if m.server is not None:
        out["server"]["batch_sizes"] = {str(b): n for b, n in m.server.batch_sizes.items()}
    return out


def to_json(result: BenchResult) -> dict[str, Any]:
    key = result.settings.mode
    return {
        "settings": _settings_json(result.settings),
        "inputs": [asdict(spec) for spec in result.inputs],
        "levels": [
            {
                key: level.level,
                "stable": level.stable,
                "result": _measurement_json(level.result),
                "windows": [_measurement_json(t) for t in level.trials],
            }
            for level in result.levels
        ],
    }


def _latency_points(result: BenchResult) -> list[tuple[str, float, Latency]]:
    mode = result.settings.mode
    return [
        (level_label(mode, lv.level), lv.result.throughput, lv.result.latency)
        for lv in result.levels
        if lv.result.latency is not None
    ]


def _batch_counts(result: BenchResult) -> list[tuple[str, dict[int, int]]]:
    mode = result.settings.mode
    return [
        (level_label(mode, lv.level), lv.result.server.batch_sizes)
        for lv in result.levels
        if lv.result.server is not None and lv.result.server.batch_sizes
    ]


def write_plot(result: BenchResult, path: Path) -> bool:
    """Latency (p50, p99) against throughput, and the executed batch sizes per level.

    Returns False, writing nothing, when matplotlib is not installed (it is optional).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    points = _latency_points(result)
    throughput = [x for _, x, _ in points]
    left.plot(throughput, [lat.p50_us / 1e3 for _, _, lat in points], marker="o", label="p50")
    left.plot(throughput, [lat.p99_us / 1e3 for _, _, lat in points], marker="o", label="p99")
    for label, x, lat in points:
        left.annotate(label, (x, lat.p50_us / 1e3), fontsize=7)
    left.set(
        xlabel="throughput (infer/s)", ylabel="latency (ms)", title=result.settings.target.model
    )
    left.legend()
    left.grid(alpha=0.3)
    levels = _batch_counts(result)
    top = max((size for _, counts in levels for size in counts), default=1)
    labels = list(batch_buckets({}, top))
    width = 0.8 / max(len(levels), 1)
    for i, (label, counts) in enumerate(levels):
        total = sum(counts.values())
        shares = [n / total for n in batch_buckets(counts, top).values()]
        right.bar([j + i * width for j in range(len(labels))], shares, width, label=label)
    middle = width * (len(levels) - 1) / 2
    right.set_xticks([j + middle for j in range(len(labels))], labels)
    right.set(xlabel="executed batch size", ylabel="share of executions", title="batch sizes")
    if levels:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
