"""The `sluice` command: thin click layer that builds a config and calls run()."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from sluice.gateway.app import GatewayLimits
from sluice.gateway.outage import OutagePolicy
from sluice.gateway.server import GatewayConfig
from sluice.jobs_cli import jobs
from sluice.shared.drain_deadline import DEFAULT_DRAIN_TIMEOUT_S, DRAIN_TIMEOUT_HELP
from sluice.shared.idle_poll import DEFAULT_WINDOW_US
from sluice.status_cli import status

F = Callable[..., Any]


def _option(*names: str, env: str, **kwargs: Any) -> Callable[[F], F]:
    return click.option(
        *names, envvar=f"SLUICE_{env}", show_envvar=True, show_default=True, **kwargs
    )


redis_url = _option(
    "--redis-url",
    env="REDIS_URL",
    default=None,
    help="Redis to queue on (redis://, rediss://, unix://, redis+sentinel://h1:p1,h2:p2/"
    "<master>). serve starts a "
    "private embedded Redis when omitted.",
)
repository = _option(
    "--model-repository",
    env="MODEL_REPOSITORY",
    required=True,
    type=click.Path(path_type=Path),
    help="Triton model repository: <dir>/<model>/config.pbtxt and <N>/ folders.",
)
host = _option("--host", env="HOST", default="127.0.0.1", help="Address the HTTP ports bind to.")
http_port = _option(
    "--http-port", env="HTTP_PORT", default=8000, type=int, help="KServe v2 HTTP port."
)
metrics_port = _option(
    "--metrics-port", env="METRICS_PORT", default=8002, type=int, help="Prometheus /metrics port."
)
timeout = _option(
    "--request-timeout",
    env="REQUEST_TIMEOUT",
    default=300.0,
    type=float,
    help="Seconds a request may wait for its result before a 503.",
)
max_body = _option(
    "--max-body-bytes",
    env="MAX_BODY_BYTES",
    default=64 << 20,
    type=int,
    help="Largest accepted request body, as sent and once gzip/deflate is inflated (else 413).",
)
job_ttl = _option(
    "--job-ttl",
    env="JOB_TTL",
    default=3600,
    type=click.IntRange(min=1),
    help="Seconds an asynchronous job and its result are kept (POST .../jobs).",
)
claim_idle = _option(
    "--claim-idle-ms",
    env="CLAIM_IDLE_MS",
    default=10_000,
    type=click.IntRange(min=100),
    help="A request held this long by a worker that stopped refreshing it (crashed) is taken "
    "over by another worker.",
)
max_deliveries = _option(
    "--max-deliveries",
    env="MAX_DELIVERIES",
    default=3,
    type=click.IntRange(min=1),
    help="A request delivered more often than this (it kept killing workers) fails with an "
    "error and moves to the model's dead-letter stream.",
)
auth_token = _option(
    "--auth-token",
    env="AUTH_TOKEN",
    default=None,
    help="Require 'Authorization: Bearer <token>' on every request but the health probes.",
)
idle_poll = _option(
    "--idle-poll-us",
    env="IDLE_POLL_US",
    default=DEFAULT_WINDOW_US,
    type=click.IntRange(min=0),
    help="Microseconds a gateway with one request in flight, or a worker after a batch run at "
    "low load, keeps polling before it sleeps: saves CPU wake-ups on a lone request's path "
    "where idle CPUs halt (VMs), at the cost of CPU at low load only. 0: sleep at once.",
)
batch_delay = _option(
    "--batch-delay",
    env="BATCH_DELAY",
    default="fixed",
    type=click.Choice(["fixed", "adaptive"]),
    help="Batching delay of models whose config sets no BATCH_DELAY parameter: 'fixed' waits "
    "max_queue_delay_microseconds out as Triton does; 'adaptive' sends a partial batch at once "
    "while the model's requests arrive further apart than its delay.",
)
outage_grace = _option(
    "--redis-outage-grace",
    env="REDIS_OUTAGE_GRACE",
    default=15.0,
    type=click.FloatRange(min=0),
    help="Seconds the gateway holds requests while Redis is unreachable (restart, failover) "
    "and sends them once it is back; past this a request gets a 503 with Retry-After.",
)
max_held = _option(
    "--max-held-bytes",
    env="MAX_HELD_BYTES",
    default=256 << 20,
    type=click.IntRange(min=0),
    help="Request payload the gateway holds at most while Redis is unreachable; a request "
    "beyond it gets a 503 with Retry-After at once.",
)
metrics_interval = _option(
    "--metrics-interval-ms",
    env="METRICS_INTERVAL_MS",
    default=2000,
    type=click.IntRange(min=100),
    help="How often workers sample their host's CPU and memory and their GPUs (NVML) for the "
    "nv_cpu_* / nv_gpu_* metrics, as Triton's option of that name.",
)
drain_timeout = _option(
    "--drain-timeout",
    env="DRAIN_TIMEOUT",
    default=DEFAULT_DRAIN_TIMEOUT_S,
    type=click.FloatRange(min=0),
    help=DRAIN_TIMEOUT_HELP,
)
log_level = _option(
    "--log-level",
    env="LOG_LEVEL",
    default="info",
    type=click.Choice(["debug", "info", "warning", "error"]),
    help="Log level.",
)


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"
    )


def _gateway_config(
    redis: str,
    host_: str,
    http: int,
    metrics: int,
    timeout_s: float,
    body: int,
    token: str | None,
    job_ttl_s: int,
    idle_poll_us: int,
    outage: OutagePolicy,
) -> GatewayConfig:
    limits = GatewayLimits(body, timeout_s, token, job_ttl_s)
    return GatewayConfig(
        redis, host_, http, metrics, limits, idle_poll_us=idle_poll_us, outage=outage
    )


@click.group()
@click.version_option(package_name="sluice-serve")
def main() -> None:
    """sluice: Triton-compatible dynamic batching over Redis streams."""


main.add_command(jobs)
main.add_command(status)


@main.command()
@repository
@redis_url
@host
@http_port
@metrics_port
@_option(
    "--workers",
    env="WORKERS",
    default=1,
    type=click.IntRange(min=1),
    help="Worker processes to run (each serves every model).",
)
@_option(
    "--bulk-workers",
    env="BULK_WORKERS",
    default=1,
    type=click.IntRange(min=0),
    help="rq workers running bulk jobs (sluice jobs submit, POST .../bulk).",
)
@timeout
@max_body
@auth_token
@job_ttl
@claim_idle
@max_deliveries
@idle_poll
@batch_delay
@metrics_interval
@outage_grace
@max_held
@log_level
@drain_timeout
def serve(
    model_repository: Path,
    redis_url: str | None,
    host: str,
    http_port: int,
    metrics_port: int,
    workers: int,
    bulk_workers: int,
    request_timeout: float,
    max_body_bytes: int,
    auth_token: str | None,
    job_ttl: int,
    claim_idle_ms: int,
    max_deliveries: int,
    idle_poll_us: int,
    batch_delay: str,
    metrics_interval_ms: int,
    redis_outage_grace: float,
    max_held_bytes: int,
    log_level: str,
    drain_timeout: float,
) -> None:
    """Run Redis (if needed), workers and a gateway in one command."""
    from sluice import preflight
    from sluice.serve import ServeConfig, run_serve

    preflight.check_installed("sluice serve", "all")
    preflight.check_repository(model_repository)
    preflight.check_ports(host, {"--http-port": http_port, "--metrics-port": metrics_port})
    if redis_url is not None:
        preflight.check_redis(redis_url)
    _logging(log_level)
    gateway = _gateway_config(
        redis_url or "",
        host,
        http_port,
        metrics_port,
        request_timeout,
        max_body_bytes,
        auth_token,
        job_ttl,
        idle_poll_us,
        OutagePolicy(redis_outage_grace, max_held_bytes),
    )
    worker_args = ("--claim-idle-ms", str(claim_idle_ms), "--max-deliveries", str(max_deliveries))
    worker_args += ("--idle-poll-us", str(idle_poll_us), "--batch-delay", batch_delay)
    worker_args += ("--metrics-interval-ms", str(metrics_interval_ms))
    run_serve(
        ServeConfig(
            model_repository,
            gateway,
            workers,
            embedded_redis=redis_url is None,
            worker_args=worker_args,
            bulk_workers=bulk_workers,
            log_level=log_level,
            drain_timeout_s=drain_timeout,
        )
    )


@main.command()
@_option("--redis-url", env="REDIS_URL", required=True, help="Redis the workers queue on.")
@host
@http_port
@metrics_port
@timeout
@max_body
@auth_token
@job_ttl
@idle_poll
@outage_grace
@max_held
@log_level
@drain_timeout
def gateway(
    redis_url: str,
    host: str,
    http_port: int,
    metrics_port: int,
    request_timeout: float,
    max_body_bytes: int,
    auth_token: str | None,
    job_ttl: int,
    idle_poll_us: int,
    redis_outage_grace: float,
    max_held_bytes: int,
    log_level: str,
    drain_timeout: float,
) -> None:
    """Run one stateless gateway (HTTP API + metrics) against a shared Redis."""
    import uvloop

    from sluice import preflight
    from sluice.gateway.server import serve_gateway

    preflight.check_ports(host, {"--http-port": http_port, "--metrics-port": metrics_port})
    preflight.check_redis_url(redis_url)
    _logging(log_level)
    config = _gateway_config(
        redis_url,
        host,
        http_port,
        metrics_port,
        request_timeout,
        max_body_bytes,
        auth_token,
        job_ttl,
        idle_poll_us,
        OutagePolicy(redis_outage_grace, max_held_bytes),
    )
    config = dataclasses.replace(config, graceful_shutdown_s=drain_timeout)
    logger = logging.getLogger("sluice.gateway")
    uvloop.run(
        serve_gateway(
            config,
            on_ready=lambda: logger.info("sluice ready: http://%s:%d", host, http_port),
        )
    )


@main.command()
@repository
@_option("--redis-url", env="REDIS_URL", required=True, help="Redis the gateways queue on.")
@_option(
    "--models",
    env="MODELS",
    default=None,
    help="Comma-separated models to serve (default: every model in the repository).",
)
@claim_idle
@max_deliveries
@_option(
    "--health-port",
    env="HEALTH_PORT",
    default=None,
    type=int,
    help="Serve GET /v2/health/live and /v2/health/ready (for orchestrator probes) here.",
)
@_option("--host", env="HOST", default="127.0.0.1", help="Address the health port binds to.")
@idle_poll
@batch_delay
@metrics_interval
@log_level
@drain_timeout
def worker(
    model_repository: Path,
    redis_url: str,
    models: str | None,
    claim_idle_ms: int,
    max_deliveries: int,
    health_port: int | None,
    host: str,
    idle_poll_us: int,
    batch_delay: str,
    metrics_interval_ms: int,
    log_level: str,
    drain_timeout: float,
) -> None:
    """Run one worker process serving the repository's models."""
    from sluice import preflight

    preflight.check_installed("sluice worker", "worker")
    from sluice.workers.recovery import RecoveryPolicy
    from sluice.workers.worker import WorkerConfig, run_worker

    preflight.check_repository(model_repository)
    preflight.check_ports(host, {"--health-port": health_port})
    preflight.check_redis_url(redis_url)
    _logging(log_level)
    wanted = tuple(m.strip() for m in models.split(",") if m.strip()) if models else None
    recovery = RecoveryPolicy(claim_idle_ms, max_deliveries)
    run_worker(
        WorkerConfig(
            model_repository,
            redis_url,
            wanted,
            recovery=recovery,
            health_port=health_port,
            health_host=host,
            idle_poll_us=idle_poll_us,
            batch_delay=batch_delay,
            drain_timeout_s=drain_timeout,
            metrics_interval_ms=metrics_interval_ms,
        )
    )


@main.command()
@_option(
    "--url",
    env="BENCH_URL",
    default="127.0.0.1:8000",
    help="KServe v2 HTTP endpoint (host:port) of sluice, Triton or any compatible server.",
)
@_option("--model", env="BENCH_MODEL", required=True, help="Model to send load to.")
@_option(
    "--concurrency",
    env="BENCH_CONCURRENCY",
    default=None,
    help="Comma-separated concurrencies to sweep: that many connections, each sending its "
    "next request when the last is answered (default 1,8,32,64).",
)
@_option(
    "--request-rate",
    env="BENCH_REQUEST_RATE",
    default=None,
    help="Comma-separated request rates (req/s) to sweep instead: requests are sent on "
    "schedule whatever the answers (open loop).",
)
@_option(
    "--distribution",
    env="BENCH_DISTRIBUTION",
    default="constant",
    type=click.Choice(["constant", "poisson"]),
    help="Intervals between scheduled requests with --request-rate.",
)
@_option(
    "--batch-size",
    env="BENCH_BATCH_SIZE",
    default=1,
    type=click.IntRange(min=1),
    help="Rows per request (the leading dim of every input when the model batches).",
)
@_option(
    "--input-data",
    env="BENCH_INPUT_DATA",
    default="random",
    type=click.Choice(["random", "zeros"]),
    help="Tensor contents, shaped from the model's metadata (variable dims become 1).",
)
@_option(
    "--binary/--json",
    env="BENCH_BINARY",
    default=True,
    help="Send tensors with the binary tensor extension, or as JSON.",
)
@_option(
    "--window-ms",
    env="BENCH_WINDOW_MS",
    default=3000,
    type=click.IntRange(min=1),
    help="Length of one measurement window.",
)
@_option(
    "--stability-percent",
    env="BENCH_STABILITY_PERCENT",
    default=20.0,
    type=click.FloatRange(min=0),
    help="A level is done when its last 3 windows are within this of each other's mean, "
    "for throughput and p95 latency.",
)
@_option(
    "--max-trials",
    env="BENCH_MAX_TRIALS",
    default=10,
    type=click.IntRange(min=1),
    help="Windows per level at most; the last 3 are reported even when not stable.",
)
@_option(
    "--warmup-s",
    env="BENCH_WARMUP_S",
    default=1.0,
    type=click.FloatRange(min=0),
    help="Seconds of load at each level before its first window.",
)
@_option(
    "--json-out",
    env="BENCH_JSON_OUT",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write every window and result as JSON here.",
)
@_option(
    "--plot-out",
    env="BENCH_PLOT_OUT",
    default=None,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write a PNG of latency vs throughput and batch sizes here (needs matplotlib: "
    "pip install 'sluice[bench]').",
)
@_option(
    "--auth-token",
    env="AUTH_TOKEN",
    default=None,
    help="Send 'Authorization: Bearer <token>' with every request.",
)
def bench(
    url: str,
    model: str,
    concurrency: str | None,
    request_rate: str | None,
    distribution: str,
    batch_size: int,
    input_data: str,
    binary: bool,
    window_ms: int,
    stability_percent: float,
    max_trials: int,
    warmup_s: float,
    json_out: Path | None,
    plot_out: Path | None,
    auth_token: str | None,
) -> None:
    """Measure throughput and latency of a model on any KServe v2 HTTP server."""
    import orjson

    from sluice.bench import report
    from sluice.bench.loadgen import BenchError, run_bench
    from sluice.bench.settings import BenchSettings, Target, parse_levels, parse_url
    from sluice.bench.stats import Measurement

    if concurrency and request_rate:
        raise click.UsageError("give --concurrency or --request-rate, not both")
    try:
        host, port = parse_url(url)
        levels = (
            parse_levels(request_rate, integer=False)
            if request_rate
            else parse_levels(concurrency or "1,8,32,64", integer=True)
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    settings = BenchSettings(
        Target(host, port, model, auth_token),
        "request_rate" if request_rate else "concurrency",
        levels,
        distribution,  # type: ignore[arg-type]
        batch_size,
        input_data,  # type: ignore[arg-type]
        binary,
        window_ms / 1e3,
        stability_percent,
        max_trials,
        warmup_s,
    )

    def on_window(level: float, trial: int, measurement: Measurement) -> None:
        line = report.progress_line(settings.mode, level, trial, max_trials, measurement)
        click.echo(line, err=True)

    try:
        result = run_bench(settings, on_window)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(report.table(result))
    if json_out is not None:
        json_out.write_bytes(orjson.dumps(report.to_json(result), option=orjson.OPT_INDENT_2))
    if plot_out is not None and not report.write_plot(result, plot_out):
        click.echo("matplotlib is not installed (pip install 'sluice[bench]'): no plot", err=True)
