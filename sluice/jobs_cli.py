"""`sluice jobs`: bulk jobs from the command line, and the rq worker that runs them."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import click
import redis

from sluice.options_cli import settings_command
from sluice.runtime_file import local_serve_options, redis_url_or_local
from sluice.settings import JOBS_WORKER_SETTINGS_ENV, JobsWorkerSettings
from sluice.shared.bulk import (
    DEFAULT_TTL_S,
    DEFAULT_WINDOW,
    BulkStatus,
    bulk_output,
    bulk_queue,
    bulk_status,
    cancel_bulk,
    list_bulks,
    submit_bulk,
)
from sluice.shared.bulk_files import format_of
from sluice.shared.drain_deadline import DrainDeadline
from sluice.shared.errors import SluiceError
from sluice.shared.redis_client import REDIS_ERRORS, sync_client

POLL_S = 0.5
BAR_WIDTH = 30
FINISHED = ("done", "failed", "cancelled")


def _connect(given: str | None, serve_pid: int | None) -> redis.Redis:
    url = redis_url_or_local(given, serve_pid)
    try:
        return sync_client(url)
    except (ValueError, *REDIS_ERRORS) as exc:
        raise click.ClickException(f"Redis at {url!r}: {exc}") from None


def progress_line(status: BulkStatus) -> str:
    """`[#####-----]  5,000/10,000  50%  running` plus failed items, for a person to read."""
    share = status.done / status.total if status.total else 1.0
    filled = round(share * BAR_WIDTH)
    line = (
        f"{status.id}  [{'#' * filled}{'-' * (BAR_WIDTH - filled)}]  "
        f"{status.done:,}/{status.total:,}  {share:4.0%}  {status.status}"
    )
    if status.failed:
        line += f"  ({status.failed:,} items failed)"
    if status.error:
        line += f"  error: {status.error}"
    return line


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a bulk operation; its typed error becomes a clean CLI error."""
    try:
        return fn(*args, **kwargs)
    except SluiceError as exc:
        raise click.ClickException(exc.message) from None
    except REDIS_ERRORS as exc:
        raise click.ClickException(f"Redis: {exc}") from None


def _follow(connection: redis.Redis, bulk_id: str) -> BulkStatus:
    """Print progress until the job ends (a line per update, so logs read well too)."""
    last = None
    while True:
        status = _call(bulk_status, connection, bulk_id)
        line = progress_line(status)
        if line != last:
            click.echo(line, err=True)
            last = line
        if status.status in FINISHED:
            return status
        time.sleep(POLL_S)


def _save(connection: redis.Redis, bulk_id: str, output: Path) -> None:
    _, data = _call(bulk_output, connection, bulk_id)
    if data is None:
        raise click.ClickException(f"bulk job '{bulk_id}' has no results yet")
    output.write_bytes(data)
    click.echo(f"wrote {output} ({len(data):,} bytes)", err=True)


@click.group()
def jobs() -> None:
    """Bulk jobs: a file of inputs through a model, results in input order (runs on rq)."""


@jobs.command()
@local_serve_options
@click.option("--model", required=True, help="Model to run every item through.")
@click.option(
    "--input",
    "input_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help=".npz (one array per input, a row per item), .npy (one-input models) or .jsonl "
    "(one KServe v2 infer body per line).",
)
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Wait for the job and write its results here (.npz for arrays, .jsonl for lines).",
)
@click.option("--id", "bulk_id", default=None, help="Job id; submitting it again is a no-op.")
@click.option("--version", type=int, default=None, help="Model version (default: newest).")
@click.option(
    "--window",
    type=click.IntRange(min=1),
    default=DEFAULT_WINDOW,
    show_default=True,
    help="Items in flight at once (at most half the model's max_queue_size).",
)
@click.option(
    "--ttl",
    "ttl_s",
    type=click.IntRange(min=60),
    default=DEFAULT_TTL_S,
    show_default=True,
    help="Seconds the job and its results are kept.",
)
def submit(
    redis_url: str | None,
    serve_pid: int | None,
    model: str,
    input_path: Path,
    output: Path | None,
    bulk_id: str | None,
    version: int | None,
    window: int,
    ttl_s: int,
) -> None:
    """Queue a bulk job; prints its id (and waits for it with --output)."""
    connection = _connect(redis_url, serve_pid)
    fmt = _call(format_of, input_path.name)
    status = _call(
        submit_bulk,
        connection,
        model,
        input_path.read_bytes(),
        fmt,
        bulk_id=bulk_id,
        version=version,
        window=window,
        ttl_s=ttl_s,
    )
    click.echo(status.id)
    if output is None:
        return
    final = _follow(connection, status.id)
    if final.status != "done":
        raise click.ClickException(f"bulk job '{status.id}' ended {final.status}")
    _save(connection, status.id, output)


@jobs.command()
@local_serve_options
@click.argument("bulk_id")
@click.option("--watch", is_flag=True, help="Follow the job until it ends.")
def status(redis_url: str | None, serve_pid: int | None, bulk_id: str, watch: bool) -> None:
    """Progress of a bulk job."""
    connection = _connect(redis_url, serve_pid)
    if watch:
        _follow(connection, bulk_id)
    else:
        click.echo(progress_line(_call(bulk_status, connection, bulk_id)))


@jobs.command(name="list")
@local_serve_options
def list_(redis_url: str | None, serve_pid: int | None) -> None:
    """Bulk jobs rq still keeps, newest first."""
    for status in _call(list_bulks, _connect(redis_url, serve_pid)):
        click.echo(f"{progress_line(status)}  model={status.model}")


@jobs.command()
@local_serve_options
@click.argument("bulk_id")
def cancel(redis_url: str | None, serve_pid: int | None, bulk_id: str) -> None:
    """Stop feeding a bulk job (items already queued still run)."""
    click.echo(progress_line(_call(cancel_bulk, _connect(redis_url, serve_pid), bulk_id)))


@jobs.command()
@local_serve_options
@click.argument("bulk_id")
@click.option("--output", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--wait", is_flag=True, help="Wait for the job to end first.")
def result(
    redis_url: str | None, serve_pid: int | None, bulk_id: str, output: Path, wait: bool
) -> None:
    """Write a finished bulk job's results file."""
    connection = _connect(redis_url, serve_pid)
    if wait:
        _follow(connection, bulk_id)
    _save(connection, bulk_id, output)


@jobs.command()
@settings_command(JobsWorkerSettings, handed_down=JOBS_WORKER_SETTINGS_ENV)
def worker(settings: JobsWorkerSettings) -> None:
    """Run an rq worker for bulk jobs (any number, on any host that reaches the Redis).

    A bulk job cut short by --drain-timeout-s is resumed by another rq worker.
    """
    from sluice.workers.bulk import MAINTENANCE_S, BulkWorker, QuietMaintenance

    level = settings.log_level.upper()
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
    )
    logging.getLogger("rq.worker").addFilter(QuietMaintenance())
    connection = _connect(settings.redis_url, None)
    rq_worker = BulkWorker(
        [bulk_queue(connection)],
        connection=connection,
        serializer=bulk_queue(connection).serializer,
        maintenance_interval=MAINTENANCE_S,
    )
    rq_worker.drain = DrainDeadline(settings.drain_timeout_s, "bulk worker", rq_worker.in_hand)
    rq_worker.work(burst=settings.burst, with_scheduler=False, logging_level=level)
