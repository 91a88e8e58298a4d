"""The `sluice` command: thin click layer that builds a role's settings and calls run()."""

from __future__ import annotations

import logging
import os

import click

from sluice.bench.settings import BenchSettings
from sluice.jobs_cli import jobs
from sluice.options_cli import settings_command
from sluice.settings import (
    GATEWAY_SETTINGS_ENV,
    WORKER_SETTINGS_ENV,
    GatewaySettings,
    ProcessSettings,
    ServeSettings,
    WorkerSettings,
)
from sluice.shared.log_control import install
from sluice.shared.log_settings import LogSettings
from sluice.status_cli import status
from sluice.tune.settings import TuneSettings


def _logging(settings: ProcessSettings) -> None:
    log_file = "" if settings.log_file is None else str(settings.log_file)
    install(LogSettings.from_level(settings.log_level, log_file, settings.log_format))


@click.group()
@click.version_option(package_name="sluice-serve")
def main() -> None:
    """sluice: Triton-compatible dynamic batching over Redis streams."""


main.add_command(jobs)
main.add_command(status)


@main.command()
@settings_command(ServeSettings)
def serve(settings: ServeSettings) -> None:
    """Run Redis (if needed), workers and a gateway in one command."""
    # serve forks only to exec its children, so gRPC's fork handlers (which log a line for every
    # fork made while the gateway's gRPC threads run) have nothing to protect; gRPC reads this
    # when first imported, which sluice.serve does
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from sluice import preflight
    from sluice.serve import run_serve

    preflight.check_installed("sluice serve", "all")
    preflight.check_repository(settings.model_repository)
    ports = {
        "--http-port": settings.http_port,
        "--metrics-port": settings.metrics_port,
        "--grpc-port": settings.grpc_port or None,
    }
    preflight.check_ports(settings.host, ports)
    if settings.redis_url is not None:
        preflight.check_redis(settings.redis_url)
    _logging(settings)
    run_serve(settings)


@main.command()
@settings_command(GatewaySettings, handed_down=GATEWAY_SETTINGS_ENV)
def gateway(settings: GatewaySettings) -> None:
    """Run one stateless gateway (HTTP API + metrics) against a shared Redis."""
    import uvloop

    from sluice import preflight
    from sluice.gateway.server import serve_gateway

    ports = {
        "--http-port": settings.http_port,
        "--metrics-port": settings.metrics_port,
        "--grpc-port": settings.grpc_port or None,
    }
    if not settings.share_ports:  # shared ports are taken already, by the other gateways
        preflight.check_ports(settings.host, ports)
    _logging(settings)
    if settings.gateway_count() > 1:
        from sluice.serve import run_gateways

        run_gateways(settings)
        return
    logger = logging.getLogger("sluice.gateway")

    def announce() -> None:
        grpc = f", gRPC on :{settings.grpc_port}" if settings.grpc_port else ""
        logger.info("sluice ready: http://%s:%d%s", settings.host, settings.http_port, grpc)

    uvloop.run(serve_gateway(settings.config(), on_ready=announce))


@main.command()
@settings_command(WorkerSettings, handed_down=WORKER_SETTINGS_ENV)
def worker(settings: WorkerSettings) -> None:
    """Run one worker process serving the repository's models."""
    from sluice import preflight

    preflight.check_installed("sluice worker", "worker")
    from sluice.workers.worker import run_worker

    preflight.check_repository(settings.model_repository)
    preflight.check_ports(settings.host, {"--health-port": settings.health_port})
    _logging(settings)
    run_worker(settings.config())


@main.command()
@settings_command(BenchSettings)
def bench(settings: BenchSettings) -> None:
    """Measure throughput and latency of a model on any KServe v2 HTTP server."""
    import orjson

    from sluice.bench import report
    from sluice.bench.loadgen import BenchError, run_bench
    from sluice.bench.stats import Measurement

    def on_window(level: float, trial: int, measurement: Measurement) -> None:
        line = report.progress_line(settings.mode, level, trial, settings.max_trials, measurement)
        click.echo(line, err=True)

    try:
        result = run_bench(settings, on_window)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(report.table(result))
    if settings.json_out is not None:
        document = orjson.dumps(report.to_json(result), option=orjson.OPT_INDENT_2)
        settings.json_out.write_bytes(document)
    if settings.plot_out is not None and not report.write_plot(result, settings.plot_out):
        click.echo(
            "matplotlib is not installed (pip install 'sluice-serve[bench]'): no plot", err=True
        )


@main.command()
@settings_command(TuneSettings)
def tune(settings: TuneSettings) -> None:
    """Find the batching config that serves the most at a p99 objective (live reloads)."""
    import sys
    import time

    from sluice.bench.loadgen import BenchError
    from sluice.tune import report
    from sluice.tune.candidates import Candidate
    from sluice.tune.measure import TuneError
    from sluice.tune.run import tune as run_tune
    from sluice.tune.run import write_outputs
    from sluice.tune.server import ServeFailed

    began = time.monotonic()
    with click.progressbar(length=int(settings.budget_s), label="tuning", file=sys.stderr) as bar:

        def on_progress(candidate: Candidate) -> None:
            bar.label = candidate.label()
            bar.update(min(int(time.monotonic() - began), bar.length) - bar.pos)

        try:
            tuned = run_tune(settings, on_progress)
        except (TuneError, ServeFailed, BenchError) as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(
        report.table(
            tuned.outcomes, tuned.objective, tuned.pick, settings.price_per_hour, settings.workers
        )
    )
    for path in write_outputs(settings, tuned):
        click.echo(f"wrote {path}")
    if settings.price_per_hour is not None:
        click.echo(
            f"cost at ${settings.price_per_hour:g} per worker-hour x {settings.workers} "
            f"worker(s); give workers --price-per-hour {settings.price_per_hour:g} for the "
            "dashboard's cost panel"
        )
    if tuned.pick is None:
        raise click.ClickException(f"no candidate met p99 <= {settings.p99_ms:g} ms")
    click.echo(f"pick: {tuned.pick.label()}")
