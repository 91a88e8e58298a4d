"""`sluice status`: who is in the fleet and how long each model's queue is, from Redis alone."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import click
import orjson
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from sluice.runtime_file import local_serve_options, redis_url_or_local
from sluice.shared.fleet import fleet_status
from sluice.shared.redis_client import REDIS_ERRORS, async_client

REFRESH_S = 1.0
NONE = "-"
#: the width of the tables when written to a file or a pipe: wide enough never to wrap a row
#: (rich would squeeze them to 80 columns), and a table takes only the width it needs.
UNBOUNDED_WIDTH = 10_000


def seconds(ms: int | None, suffix: str = "") -> str:
    """`0.4 s ago`, `12 s`, `3 min`: as precise as a person needs."""
    if ms is None:
        return NONE
    if ms < 10_000:
        text = f"{ms / 1000:.1f} s"
    elif ms < 120_000:
        text = f"{ms // 1000} s"
    else:
        text = f"{ms // 60_000} min"
    return f"{text}{suffix}"


def count(value: int | None) -> str:
    return NONE if value is None else f"{value:,}"


def members_table(members: list[dict[str, Any]]) -> Table:
    table = Table(title="Fleet", title_justify="left")
    for column in ("kind", "id", "host", "pid", "models (instances)", "devices"):
        table.add_column(column)
    for column in ("batches", "batches/s", "heartbeat"):
        table.add_column(column, justify="right")
    for m in members:
        models = ", ".join(
            f"{name} ({s['instances']})" if m["kind"] == "worker" else name
            for name, s in m["models"].items()
        )
        worker = m["kind"] == "worker"
        table.add_row(
            m["kind"],
            m["id"],
            m["host"],
            str(m["pid"]),
            models or NONE,
            ", ".join(m.get("devices") or ()) or NONE,
            count(m.get("batches")) if worker else NONE,
            f"{m.get('batches_per_s', 0.0):,.1f}" if worker else NONE,
            seconds(m["heartbeat_age_ms"], " ago"),
        )
    return table


def models_table(models: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="Models", title_justify="left")
    table.add_column("model")
    for column in ("queued", "lag", "pending", "oldest waiting", "dead letters"):
        table.add_column(column, justify="right")
    table.add_column("workers by state")
    table.add_column("served by")
    for name, m in models.items():
        served = ", ".join(m["workers"]) or f"nobody ({m['error'] or 'no live worker'})"
        by_state = ", ".join(f"{state} {n}" for state, n in m.get("states", {}).items())
        table.add_row(
            name,
            count(m["queue_depth"]),
            count(m["lag"]),
            count(m["pending"]),
            seconds(m["oldest_waiting_ms"]),
            count(m["dead_letters"]),
            by_state or NONE,
            served,
        )
    return table


def render(status: dict[str, Any]) -> Group:
    """Both tables, for a terminal."""
    return Group(members_table(status["members"]), models_table(status["models"]))


async def _show(redis_url: str, as_json: bool, watch: bool) -> None:
    client = async_client(redis_url)
    console = Console() if sys.stdout.isatty() else Console(width=UNBOUNDED_WIDTH)
    try:
        if not watch:
            status = await fleet_status(client)
            if as_json:
                click.echo(orjson.dumps(status, option=orjson.OPT_INDENT_2))
            else:
                console.print(render(status))
            return
        if as_json:  # one JSON document per line, for tools that follow it
            while True:
                click.echo(orjson.dumps(await fleet_status(client)))
                await asyncio.sleep(REFRESH_S)
        with Live(render(await fleet_status(client)), console=console, auto_refresh=False) as live:
            while True:
                await asyncio.sleep(REFRESH_S)
                live.update(render(await fleet_status(client)), refresh=True)
    finally:
        await client.aclose()


@click.command()
@local_serve_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
@click.option("--watch", is_flag=True, help="Refresh every second until Ctrl-C.")
def status(redis_url: str | None, serve_pid: int | None, as_json: bool, watch: bool) -> None:
    """Live workers and gateways, and each model's queue (depth, pending, dead letters)."""
    try:
        asyncio.run(_show(redis_url_or_local(redis_url, serve_pid), as_json, watch))
    except KeyboardInterrupt:
        pass
    except REDIS_ERRORS as exc:
        raise click.ClickException(f"Redis: {exc}") from None
