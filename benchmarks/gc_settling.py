"""Whether the gateway's settled garbage collector (shared/gc_tuning.py) still pays: the same
gateway with it and with CPython's default collector, side by side in one run.

One Redis and one worker on examples/model_repository's `mlp`; each gateway variant is started
in turn and driven at c=1 and c=64 (perf_analyzer, else `sluice bench`), the order alternating
from round to round. Each gateway times its own collections (gc.callbacks), so besides
throughput and latency, which a shared machine's other loads disturb, the table gives what
the collector itself cost per inference: its time and how many collections ran. Ratios are
paired with the settled gateway's figure in the same round.

    python benchmarks/gc_settling.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from http_servers import LEVELS, measure_gateway, mlp_fleet  # noqa: E402

VARIANTS = ("settled", "default")
#: `sluice gateway` timing its collections into the file argv[1] (rewritten every 0.2 s);
#: with argv[2] == "default", settle_after_startup is a no-op: CPython's collector as it starts.
GATEWAY = """
import gc, json, os, sys, threading, time
path, variant = sys.argv[1:3]
PUBLISH_EVERY_S = 0.2
spent_s, runs, started_s = [0.0, 0.0, 0.0], [0, 0, 0], [0.0]
def timed(phase, info):
    if phase == "start":
        started_s[0] = time.perf_counter()
    else:
        spent_s[info["generation"]] += time.perf_counter() - started_s[0]
        runs[info["generation"]] += 1
def publish():
    while True:
        time.sleep(PUBLISH_EVERY_S)
        with open(path + ".tmp", "w") as out:
            json.dump({"gc_us": sum(spent_s) * 1e6, "collections": sum(runs), "full": runs[2]}, out)
        os.replace(path + ".tmp", path)
gc.callbacks.append(timed)
threading.Thread(target=publish, daemon=True).start()
if variant == "default":
    import sluice.shared.gc_tuning as tuning
    tuning.settle_after_startup = lambda: None
sys.argv[:3] = ["sluice"]
from sluice.cli import main
main()
"""


def gateway_command(variant: str, stats: Path, redis_url: str, port: int) -> list[str]:
    options = ["--redis-url", redis_url, "--http-port", str(port), "--grpc-port", str(port + 1)]
    options += ["--metrics-port", str(port + 2), "--log-level", "warning"]
    return [sys.executable, "-c", GATEWAY, str(stats), variant, "gateway", *options]


def gc_counters(stats: Path) -> dict[str, float]:
    try:
        return {k: float(v) for k, v in json.loads(stats.read_text()).items()}
    except FileNotFoundError:  # no collection published yet
        return {"gc_us": 0.0, "collections": 0.0, "full": 0.0}


COLUMNS = (
    ("throughput", "{:,.0f}"),
    ("p99_ms", "{:.1f}"),
    ("gateway_cpu_us", "{:.0f}"),
    ("gc_us_per_infer", "{:.2f}"),
    ("collections_per_infer", "{:.4f}"),
    ("full_per_infer", "{:.5f}"),
)


def report(rows: list[dict], rounds: int) -> str:
    found = {(r["label"], r["concurrency"], r["round"]): r for r in rows if "throughput" in r}
    lines = [
        f"Gateway garbage collection, reference MLP, one worker; medians of {rounds} rounds "
        "(order alternating); default / settled: median (lowest, highest) of the same round's "
        "ratio",
        "",
        "| gc | level | infer/s | p99 ms | gateway CPU us/infer | GC us/infer | collections/infer "
        "| full collections/infer | infer/s default/settled | CPU default/settled |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        for level in LEVELS:
            runs = [r for (v, c, _), r in found.items() if (v, c) == (variant, level)]
            if not runs:
                lines.append(f"| {variant} | c={level} | failed |" + " |" * 7)
                continue
            cells = [variant, f"c={level}"]
            cells += [form.format(statistics.median(r[key] for r in runs)) for key, form in COLUMNS]
            pairs = [
                (r, found[("settled", level, n)])
                for (v, c, n), r in found.items()
                if (v, c) == (variant, level) and ("settled", level, n) in found
            ]
            cells += [
                _ratio([r[key] / s[key] for r, s in pairs])
                for key in ("throughput", "gateway_cpu_us")
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}, {max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--port", type=int, default=18840)
    parser.add_argument("--json-out", type=Path, default=ROOT / "benchmarks" / "out" / "gc.json")
    args = parser.parse_args()
    rows: list[dict] = []
    with mlp_fleet() as redis_url, tempfile.TemporaryDirectory() as scratch:
        for round_number in range(args.rounds):
            order = VARIANTS if round_number % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                port = args.port + 10 * VARIANTS.index(variant)  # no wait on a closing port
                stats = Path(scratch) / f"{variant}-{round_number}.json"
                command = gateway_command(variant, stats, redis_url, port)
                probe = functools.partial(gc_counters, stats)
                for row in measure_gateway(command, variant, port, probe):
                    rows.append(row | {"round": round_number})
    print(report(rows, args.rounds))
    args.json_out.parent.mkdir(exist_ok=True)
    args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
