"""The peer comparison as markdown: settings, one row per server, protocol and concurrency, and
sluice's ratios (each variant's) to the best peer (throughput and p99 at the highest
concurrency, p50 at the lowest)."""

from __future__ import annotations

from typing import Any

from peer_servers import is_sluice

Row = dict[str, Any]


def _cells(row: Row) -> list[str]:
    if "error" in row:
        return [str(row["concurrency"]), row["peer"], row["protocol"], f"failed: {row['error']}"]
    errors = sum(row["errors"].values())
    return [
        str(row["concurrency"]),
        row["peer"],
        row["protocol"],
        f"{row['throughput']:,.0f}",
        f"{row['p50_ms']:.1f}",
        f"{row['p99_ms']:.1f}",
        f"{row['avg_batch']:.1f}" if row["avg_batch"] is not None else "-",
        f"{row['server_cpu_ms']:.2f}",
        f"{row['loadgen_cpu_ms']:.2f}",
        f"{row['machine_busy'] * 100:.0f} %",
        str(errors) if errors else "0",
    ]


def _best_peer(rows: list[Row], concurrency: int, key: str, lowest: bool) -> Row | None:
    found = [
        r for r in rows if r["concurrency"] == concurrency and not is_sluice(r["peer"]) and key in r
    ]
    if not found:
        return None
    return (min if lowest else max)(found, key=lambda r: r[key])


def ratios(rows: list[Row], levels: list[int]) -> list[str]:
    """sluice (each variant and protocol) against the best peer (any protocol)."""
    low, high = min(levels), max(levels)
    top = _best_peer(rows, high, "throughput", lowest=False)
    fastest = _best_peer(rows, low, "p50_ms", lowest=True)
    lines = []
    served = sorted({r["peer"] for r in rows if is_sluice(r["peer"])}, key=len)
    for name, protocol in ((n, p) for n in served for p in ("json", "binary")):
        ours = {
            r["concurrency"]: r
            for r in rows
            if r["peer"] == name and r["protocol"] == protocol and "throughput" in r
        }
        if high in ours and top is not None:
            s = ours[high]
            lines.append(
                f"- c={high}, {name} {protocol} / best peer ({top['peer']} {top['protocol']}): "
                f"throughput {s['throughput'] / top['throughput']:.2f}x "
                f"({s['throughput']:,.0f} vs {top['throughput']:,.0f}/s), "
                f"p99 {s['p99_ms'] / top['p99_ms']:.2f}x ({s['p99_ms']:.1f} vs "
                f"{top['p99_ms']:.1f} ms; below 1 is better)"
            )
        if low in ours and fastest is not None:
            s = ours[low]
            lines.append(
                f"- c={low}, {name} {protocol} p50 {s['p50_ms']:.2f} ms vs the lowest peer's "
                f"({fastest['peer']} {fastest['protocol']}) {fastest['p50_ms']:.2f} ms: "
                f"{s['p50_ms'] / fastest['p50_ms']:.2f}x"
            )
    return lines


def report(meta: dict[str, Any], rows: list[Row]) -> str:
    levels = sorted({r["concurrency"] for r in rows})
    lines = [
        f"### sluice and its peers on the reference MLP, {meta['date']} (`{meta['command']}`)",
        "",
        f"Commit {meta['commit']}; {meta['machine']}; load average before "
        f"{meta['load_before']}, after {meta['load_after']}. One load generator for every "
        f"server ({meta['loadgen']}), closed loop, {meta['seconds']} s measured per point "
        f"in {meta['rounds']} turns, each after a {meta['warmup_s']} s warm-up; the servers "
        "all up at once and taken in turn at each concurrency (the order rotated each round), "
        "so drift hits all alike. "
        "Same model file (examples' mlp, TorchScript), torch 1 intra-op and 1 inter-op thread "
        "everywhere, same 512 floats in every body: KServe v2 JSON or binary for sluice and "
        "PyTriton, `{\"data\": [[...]]}` on the others' own JSON routes; every server's "
        "answer checked against the model run here before the run. CPU per request: the "
        "server's whole process tree and the load generator, from /proc.",
        "",
        "| server | version | batching and settings | idle CPU (cores) | listening |",
        "|---|---|---|---|---|",
    ]
    for peer, info in meta["servers"].items():
        lines.append(
            f"| {peer} | {info.get('version', '-')} | {info.get('settings', '-')} | "
            f"{info.get('idle_cores', '-')} | {info.get('listens', '-')} |"
        )
    for peer, why in meta["failed"].items():
        lines.append(f"| {peer} | - | failed: {why} | - | - |")
    lines += [
        "",
        "| c | server | protocol | infer/s | p50 ms | p99 ms | avg batch | server CPU ms/req | "
        "load gen CPU ms/req | machine busy | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in levels:
        level = [r for r in rows if r["concurrency"] == c]
        level.sort(key=lambda r: -r.get("throughput", -1))
        lines += ["| " + " | ".join(_cells(r)) + " |" for r in level]
    lines += ["", *ratios(rows, levels)]
    return "\n".join(lines) + "\n"
