"""What a worker runs with, apart from the worker so that building it needs no torch.

Built from `sluice worker`'s settings (sluice.settings), which hold every option's default:
each field named as its option is that option's value.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from sluice.shared.batch_delay import BatchDelay
from sluice.shared.repository_control import ControlMode
from sluice.shared.trace_settings import TraceSettings
from sluice.workers.recovery.recovery import RecoveryPolicy


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    model_repository: Path
    redis_url: str
    #: serve only these models (None: every model in the repository).
    models: tuple[str, ...] | None
    recovery: RecoveryPolicy
    #: serve GET /v2/health/live and /ready here (None: no probe port), bound to `host`.
    health_port: int | None
    host: str
    #: microseconds to keep polling after a batch run at low load (0: sleep at once).
    idle_poll_us: int
    #: how often the host's CPU, memory and GPUs are sampled for the heartbeat.
    metrics_interval_ms: int
    #: BATCH_DELAY of models that set none.
    batch_delay: BatchDelay
    #: run a lone batch while its delay runs out, answering it once the batch is formed
    #: (`workers/batching/early_run.py`).
    early_run: bool
    #: seconds to finish the batches in hand after a stop signal before exiting regardless.
    drain_timeout_s: float
    model_control_mode: ControlMode
    #: explicit mode: the models to load at start ("*": every one).
    load_model: tuple[str, ...]
    #: poll mode: seconds between two looks at the repository.
    repository_poll_secs: float
    #: what this worker costs per hour, exported for the dashboards' cost panel (None: not)
    price_per_hour: float | None = None
    #: Triton's trace settings (--trace-config): in OpenTelemetry mode, where spans go.
    trace_config: TraceSettings = field(default_factory=TraceSettings)
    worker_id: str = ""
    block_ms: int = 1000

    def member_id(self) -> str:
        suffix = uuid.uuid4().hex[:6]
        return self.worker_id or f"worker-{socket.gethostname()}-{os.getpid()}-{suffix}"
