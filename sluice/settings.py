"""The settings of each role sluice runs, built once from options and environment.

`sluice gateway` takes GatewaySettings, `sluice worker` WorkerSettings, `sluice serve`
ServeSettings (the gateway's and the workers' options together) and `sluice jobs worker`
JobsWorkerSettings. serve hands each child its settings as JSON in one environment variable.

Each option's default is written once: here, or, where the gateway or the workers also use it
without settings (a policy's default, a constant), there, and read from there. The gateway's and
the worker's config types are built here, and nowhere else, each field from the option of its
name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sluice.common_options import (
    REDIS_URL_HELP,
    IdlePolling,
    ModelControl,
    ProcessSettings,
    RedisPassword,
    TraceOptions,
    comma_list,
    parses,
    redis_url,
    secret_help,
)
from sluice.cores import cores_available
from sluice.gateway.dispatcher import DEFAULT_STREAM_MAX_HELD_BYTES
from sluice.gateway.grpc_options import CompressionLevel, GrpcOptions, GrpcServer
from sluice.gateway.outage import OutagePolicy
from sluice.gateway.response_cache.cache_config import parse_cache_config
from sluice.gateway.restricted_apis import GRPC_HEADER_PREFIX, Restrictions, parse_restrictions
from sluice.options import (
    Check,
    Settings,
    SettingsError,
    at_least,
    option,
    option_fields,
    port,
    positive,
)
from sluice.secret_options import one_secret
from sluice.shared.batch_delay import BatchDelay
from sluice.shared.jobs import MAX_BULK_JOBS, MAX_JOBS
from sluice.shared.repository_control import load_model_problem
from sluice.shared.trace_settings import parse_trace_config
from sluice.workers.recovery.recovery import RecoveryPolicy
from sluice.workers.worker_config import WorkerConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from sluice.gateway.server import GatewayConfig

#: the environment variables through which serve hands its children their settings.
WORKER_SETTINGS_ENV = "SLUICE_WORKER_SETTINGS"
JOBS_WORKER_SETTINGS_ENV = "SLUICE_JOBS_WORKER_SETTINGS"
GATEWAY_SETTINGS_ENV = "SLUICE_GATEWAY_SETTINGS"


#: the defaults of the policies the gateway and the workers also build without settings.
OUTAGE = OutagePolicy()
RECOVERY = RecoveryPolicy()


#: Triton's restricted-API flags: flag -> (its word in Triton's errors, the header prefix).
RESTRICTION_FLAGS = {
    "--http-restricted-api": ("api", ""),
    "--grpc-restricted-protocol": ("protocol", GRPC_HEADER_PREFIX),
}


def restrictions(flag: str, specs: tuple[str, ...]) -> Restrictions:
    kind, prefix = RESTRICTION_FLAGS[flag]
    return parse_restrictions(specs, flag, kind, prefix)


def restriction_check(flag: str) -> Check:
    """What is wrong with a restricted-API flag's values, in Triton's words."""

    def check(specs: tuple[str, ...]) -> str | None:
        try:
            restrictions(flag, specs)
        except ValueError as exc:
            return str(exc)
        return None

    return check


def restricted_option(flag: str, help: str) -> Any:
    return option((), help=help, repeat=True, check=restriction_check(flag), shown=" ".join)


@dataclass(frozen=True, kw_only=True)
class GatewayOptions(ProcessSettings, IdlePolling, ModelControl, TraceOptions):
    """A gateway's options but its Redis, which serve may start itself."""

    host: str = option("127.0.0.1", help="Address the HTTP ports bind to.")
    http_port: int = option(8000, help="KServe v2 HTTP port.", check=port)
    metrics_port: int = option(8002, help="Prometheus /metrics port.", check=port)
    grpc_port: int = option(
        8001,
        help="KServe v2 gRPC port (Triton's inference.GRPCInferenceService); 0 turns gRPC off.",
        check=lambda value: None if value == 0 else port(value),
    )
    grpc_infer_response_compression_level: CompressionLevel = option(
        "none",
        help="How much gRPC responses are compressed, as Triton's option of that name (requests "
        "a client compressed are always accepted).",
    )
    grpc_server: GrpcServer = option(
        "sluice",
        help="What serves the gRPC port: 'sluice', HTTP/2 on the gateway's own event loop, or "
        "'grpcio', grpcio's asyncio server (the same RPCs and answers; sluice's costs a "
        "fraction of the CPU per call).",
    )
    grpc_stream_max_requests: int = option(
        64,
        help="Requests of one gRPC ModelStreamInfer stream in flight at once (read, and not "
        "yet answered to the client); past them the gateway stops reading that stream.",
        check=at_least(1),
    )
    grpc_stream_max_queued_bytes: int = option(
        16 << 20,
        help="Bytes of responses one gRPC stream holds for a client that has not read them; "
        "past them its requests wait for the client (one response always fits).",
        check=at_least(1),
    )
    stream_max_held_bytes: int = option(
        DEFAULT_STREAM_MAX_HELD_BYTES,
        help="Bytes of a streamed request's responses (gRPC stream, generate_stream) the gateway "
        "holds for a client that does not read them; past them the request is stopped and "
        "answered with an error.",
        check=at_least(1),
    )
    request_timeout_s: float = option(
        300.0,
        help="Seconds a request may wait for its result before a 503.",
        old="--request-timeout",
        check=positive,
    )
    max_body_bytes: int = option(
        64 << 20,
        help="Largest accepted request body, as sent and once gzip/deflate is inflated (else "
        "413); also the largest gRPC request message (else RESOURCE_EXHAUSTED).",
        check=at_least(1),
    )
    auth_token: str | None = option(
        None,
        help=secret_help(
            "Require 'Authorization: Bearer <token>' on every request but the health probes.",
            "SLUICE_AUTH_TOKEN",
            "--auth-token-file",
        ),
    )
    auth_token_file: Path | None = option(
        None, help="A file holding the --auth-token (its line end dropped)."
    )
    metrics_auth_token: str | None = option(
        None,
        help="Require 'Authorization: Bearer <token>' on the metrics port too, which is open "
        "by default as Triton's is (--auth-token does not cover it).",
    )
    http_restricted_api: tuple[str, ...] = restricted_option(
        "--http-restricted-api",
        "Triton's <category>[,<category>...]:<key>=<value>: requests to those endpoint groups "
        "need header <key> with <value>, else 403 (repeat for more groups). Categories: health, "
        "metadata, inference, shared-memory, model-config, model-repository, statistics, "
        "trace, logging.",
    )
    grpc_restricted_protocol: tuple[str, ...] = restricted_option(
        "--grpc-restricted-protocol",
        "Triton's <category>[,<category>...]:<key>=<value> for gRPC: those RPCs need metadata "
        "triton-grpc-protocol-<key> with <value>, else UNAVAILABLE (repeat for more groups).",
    )
    max_override_models: int = option(
        64,
        help="Models loaded from a load's 'file:' overrides that the fleet holds at once (their "
        "files are kept in Redis until the model is unloaded); one more is refused with 400. "
        "0: no limit.",
        check=at_least(0),
    )
    job_ttl_s: int = option(
        3600,
        help="Seconds an asynchronous job and its result are kept (POST .../jobs).",
        old="--job-ttl",
        check=at_least(1),
    )
    max_jobs: int = option(
        MAX_JOBS,
        help="Asynchronous jobs the fleet keeps at once (each until --job-ttl-s ends); one more "
        "is refused with 503. 0: no limit.",
        check=at_least(0),
    )
    max_bulk_jobs: int = option(
        MAX_BULK_JOBS,
        help="Bulk jobs the fleet keeps at once (each until its TTL, a day, ends); one more is "
        "refused with 503. 0: no limit.",
        check=at_least(0),
    )
    redis_outage_grace_s: float = option(
        OUTAGE.grace_s,
        help="Seconds the gateway holds requests while Redis is unreachable (restart, failover) "
        "and sends them once it is back; past this a request gets a 503 with Retry-After.",
        old="--redis-outage-grace",
        check=at_least(0),
    )
    cache_config: tuple[str, ...] = option(
        (),
        help="Triton's response cache, <cache>,<key>=<value> (repeat to add keys): "
        "'local,size=<bytes>' keeps an LRU in each gateway; 'redis' keeps one cache for the "
        "whole fleet on its Redis (or host=,port= another), each entry for ttl=<s> (600). "
        "Models opt in with response_cache { enable: true }.",
        repeat=True,
        check=parses(parse_cache_config),
        shown=" ".join,
    )
    share_ports: bool = option(
        False,
        help="Bind the HTTP, gRPC and metrics ports with SO_REUSEPORT, so that several gateway "
        "processes of this host take connections on the same ports (serve --gateways does).",
    )
    max_held_bytes: int = option(
        OUTAGE.max_held_bytes,
        help="Request payload the gateway holds at most while Redis is unreachable; a request "
        "beyond it gets a 503 with Retry-After at once.",
        check=at_least(0),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        token = one_secret(
            self.auth_token, self.auth_token_file, "--auth-token", "--auth-token-file"
        )
        object.__setattr__(self, "auth_token", token)
        object.__setattr__(self, "auth_token_file", None)

    def gateway_config(self, redis_url: str) -> GatewayConfig:
        from sluice.gateway.core import GatewayLimits
        from sluice.gateway.server import GatewayConfig

        grpc = GrpcOptions(
            port=self.grpc_port,
            max_message_bytes=self.max_body_bytes,
            compression=self.grpc_infer_response_compression_level,
            stream_max_requests=self.grpc_stream_max_requests,
            stream_max_queued_bytes=self.grpc_stream_max_queued_bytes,
            server=self.grpc_server,
        )
        limits = _built(
            GatewayLimits,
            self,
            http_restrictions=restrictions("--http-restricted-api", self.http_restricted_api),
            grpc_restrictions=restrictions(
                "--grpc-restricted-protocol", self.grpc_restricted_protocol
            ),
        )
        outage = OutagePolicy(self.redis_outage_grace_s, self.max_held_bytes)
        cache = parse_cache_config(self.cache_config)
        return _built(
            GatewayConfig,
            self,
            redis_url=redis_url,
            grpc=grpc,
            limits=limits,
            outage=outage,
            cache_config=cache,
            trace_config=parse_trace_config(self.trace_config),
        )


@dataclass(frozen=True, kw_only=True)
class GatewaySettings(GatewayOptions, RedisPassword):
    """`sluice gateway`: a stateless gateway against a shared Redis (or several processes of
    it on the same ports)."""

    redis_url: str = redis_url("Redis the workers queue on.")
    gateways: int = option(
        1,
        help="Gateway processes to run on the same HTTP, gRPC and metrics ports (SO_REUSEPORT); "
        "0: one per core this process may use (its cgroup's CPU quota counted).",
        check=at_least(0),
    )

    def gateway_count(self) -> int:
        return self.gateways or cores_available()

    def child_settings(self) -> GatewaySettings:
        """What each gateway started beside this one runs with: the same, on shared ports."""
        return dataclasses.replace(self, gateways=1, share_ports=True)

    def config(self) -> GatewayConfig:
        return self.gateway_config(self.redis_url)


@dataclass(frozen=True, kw_only=True)
class BatchingOptions(ProcessSettings, IdlePolling, ModelControl, TraceOptions):
    """How workers batch and recover, the same for every worker serve starts."""

    model_repository: Path = option(
        help="Triton model repository: <dir>/<model>/config.pbtxt and <N>/ folders."
    )
    claim_idle_ms: int = option(
        RECOVERY.claim_idle_ms,
        help="A request held this long by a worker that stopped refreshing it (crashed) is taken "
        "over by another worker.",
        check=at_least(100),
    )
    max_deliveries: int = option(
        RECOVERY.max_deliveries,
        help="A request delivered more often than this (it kept killing workers) fails with an "
        "error and moves to the model's dead-letter stream.",
        check=at_least(1),
    )
    batch_delay: BatchDelay = option(
        "fixed",
        help="Batching delay of models whose config sets no BATCH_DELAY parameter: 'fixed' waits "
        "max_queue_delay_microseconds out as Triton does; 'adaptive' sends a partial batch at "
        "once while the model's requests arrive further apart than its delay.",
    )
    early_run: bool = option(
        True,
        flag="--early-run/--no-early-run",
        help="While no request joins a model's partial batches as they wait, run the lone "
        "batch the delay will release as it runs out, answering it only once that batch is "
        "formed (batches are as Triton's; a request joining meanwhile drops the run).",
    )
    metrics_interval_ms: int = option(
        2000,
        help="How often workers sample their host's CPU and memory and their GPUs (NVML) for the "
        "nv_cpu_* / nv_gpu_* metrics, as Triton's option of that name.",
        check=at_least(100),
    )
    load_model: tuple[str, ...] = option(
        (),
        help="Explicit mode: a model to load at start (repeat the option for more; '*': every "
        "model, and then the only one).",
        repeat=True,
    )
    price_per_hour: float | None = option(
        None,
        help="What one worker costs per hour: exported as sluice_worker_price_per_hour for the "
        "dashboard's cost per million inferences (the price sluice tune priced with).",
        check=positive,
    )
    repository_poll_secs: float = option(
        15.0,
        help="Poll mode: seconds between two looks at the repository for new, changed and "
        "removed models.",
        check=positive,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        problem = load_model_problem(self.model_control_mode, self.load_model)
        if problem:
            raise SettingsError("--load-model", f"--load-model: {problem}")


@dataclass(frozen=True, kw_only=True)
class WorkerSettings(BatchingOptions, RedisPassword):
    """`sluice worker`: one worker process serving the repository's models."""

    redis_url: str = redis_url("Redis the gateways queue on.")
    models: tuple[str, ...] | None = option(
        None,
        help="Comma-separated models to serve (default: every model in the repository).",
        parse=comma_list,
    )
    health_port: int | None = option(
        None,
        help="Serve GET /v2/health/live and /v2/health/ready (for orchestrator probes) here.",
        check=port,
    )
    host: str = option("127.0.0.1", help="Address the health port binds to.")

    def config(self) -> WorkerConfig:
        return _built(
            WorkerConfig,
            self,
            recovery=_built(RecoveryPolicy, self),
            trace_config=parse_trace_config(self.trace_config),
        )


@dataclass(frozen=True, kw_only=True)
class JobsWorkerSettings(ProcessSettings, RedisPassword):
    """`sluice jobs worker`: an rq worker running bulk jobs."""

    redis_url: str | None = redis_url(
        "Redis the fleet queues on (default: that of the sluice serve running on this machine).",
        None,
    )
    burst: bool = option(False, help="Exit once the queue is empty.")


@dataclass(frozen=True, kw_only=True)
class ServeSettings(GatewayOptions, BatchingOptions, RedisPassword):
    """`sluice serve`: Redis (if needed), workers and a gateway in one command."""

    redis_url: str | None = redis_url(
        REDIS_URL_HELP + " serve starts a private embedded Redis when omitted.", None
    )
    workers: int = option(
        1, help="Worker processes to run (each serves every model).", check=at_least(1)
    )
    gateways: int = option(
        0,
        help="Gateway processes to run, sharing the HTTP, gRPC and metrics ports (SO_REUSEPORT); "
        "0: one per four cores of this host, at least one.",
        check=at_least(0),
    )
    bulk_workers: int = option(
        1,
        help="rq workers running bulk jobs (sluice jobs submit, POST .../bulk).",
        check=at_least(0),
    )
    redis_maxmemory: int | None = option(
        None,
        help="Bytes of data the embedded Redis may hold; past them it refuses writes (a 503, "
        "gRPC RESOURCE_EXHAUSTED) instead of evicting queued work. Default: a quarter of this "
        "host's (or container's) memory; 0: no limit. Not used with --redis-url.",
        check=at_least(0),
    )

    def worker_settings(self, redis_url: str) -> WorkerSettings:
        """What every worker serve starts runs with (no probe port: serve's gateway is one)."""
        return WorkerSettings(**_values(self, BatchingOptions), redis_url=redis_url)

    def gateway_count(self) -> int:
        """--gateways, or by default one gateway per four cores."""
        return self.gateways or max(1, cores_available() // 4)

    def gateway_settings(self, redis_url: str) -> GatewaySettings:
        """What each gateway serve starts beside its own runs with: the same options, on the
        same ports, shared."""
        options = _values(self, GatewayOptions) | {"share_ports": True}
        return GatewaySettings(**options, redis_url=redis_url, gateways=1)

    def jobs_worker_settings(self, redis_url: str) -> JobsWorkerSettings:
        return JobsWorkerSettings(**_values(self, ProcessSettings), redis_url=redis_url)


def _values(settings: Settings, part: type[Settings]) -> dict[str, Any]:
    """The values of the fields `settings` shares with its base class `part`."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(part)}


C = TypeVar("C", bound="DataclassInstance")


def _built(config: type[C], settings: Settings, **given: Any) -> C:
    """A `config` whose fields but those `given` are the settings' options of their names."""
    options = {f.name for f in option_fields(type(settings))} - given.keys()
    names = [f.name for f in dataclasses.fields(config) if f.name in options]
    return config(**{name: getattr(settings, name) for name in names}, **given)
