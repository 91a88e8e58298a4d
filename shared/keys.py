"""Every Redis key sluice uses, in one place.

Keys of one model share the hash tag `{m:<model>}` so that they live in one Redis Cluster
slot; a partitioned model's partition p >= 1 has `{m<p>:<model>}` instead, so that partitions
land on different shards (shared/partitions.py). Fleet-wide keys share `{sluice}`. A
gateway's reply stream carries its own tag, since every worker of every model writes to it.
"""

from __future__ import annotations

PREFIX = "sluice"

#: consumer group every worker of a model joins on the model's request stream.
WORKER_GROUP = "workers"


def _model_tag(model: str, partition: int = 0) -> str:
    return f"{PREFIX}:{{m{partition or ''}:{model}}}"


def partition_of(key: str) -> int:
    """The partition a model's key belongs to (0: the model's own tag)."""
    start = key.index("{") + 2
    return int(key[start : key.index(":", start)] or 0)


def request_stream(model: str, level: int = 0, partition: int = 0) -> str:
    """A model's request stream (one per priority level and partition): gateways XADD,
    workers XREADGROUP."""
    suffix = f":p{level}" if level else ""
    return f"{_model_tag(model, partition)}:requests{suffix}"


def queue_sizes(model: str, partition: int = 0) -> str:
    """Hash: priority level -> requests queued or running, kept when max_queue_size is set."""
    return f"{_model_tag(model, partition)}:queued"


def cancel_channel(model: str) -> str:
    """Pub/sub channel on which gateways name requests whose client went away."""
    return f"{_model_tag(model)}:cancel"


def dead_letters(model: str) -> str:
    """Entries that kept killing workers, kept for an operator to inspect (XRANGE)."""
    return f"{_model_tag(model)}:dead"


def model_stats(model: str, partition: int = 0) -> str:
    """Hash of cumulative counters (Triton statistics), folded in from the statistics log."""
    return f"{_model_tag(model, partition)}:stats"


def model_stats_log(model: str, partition: int = 0) -> str:
    """List of the statistics records of batches not yet folded into the hash."""
    return f"{_model_tag(model, partition)}:stats:log"


def reply_stream(gateway_id: str) -> str:
    """A gateway's private reply stream: workers XADD one entry per batch per gateway."""
    return f"{PREFIX}:{{gw:{gateway_id}}}:replies"


def ensemble_state(request_id: str) -> str:
    """Hash: an ensemble request's join state (tensors waiting for a joining step), with a TTL
    of the request's timeout; its own tag, so any worker's script touches one slot."""
    return f"{PREFIX}:{{ens:{request_id}}}:join"


def job_stream(job_id: str) -> str:
    """An asynchronous job: its metadata entry, then its result entry (workers append it)."""
    return f"{PREFIX}:{{job:{job_id}}}"


def job_channel(job_id: str) -> str:
    """Pub/sub channel announcing a job's status changes: queued, done, failed, cancelled."""
    return f"{PREFIX}:job-events:{job_id}"


def job_of_stream(key: str) -> str | None:
    """The job id when `key` is a job stream (a reply route workers answer into)."""
    head = f"{PREFIX}:{{job:"
    return key[len(head) : -1] if key.startswith(head) and key.endswith("}") else None


#: hash: model name -> model metadata published by the workers that load it.
MODELS = f"{PREFIX}:{{sluice}}:models"

#: hash: member id -> heartbeat record (msgpack) of every worker and gateway.
FLEET = f"{PREFIX}:{{sluice}}:fleet"

#: hash: model name -> the fleet's desired state of the model (shared/repository_control.py):
#: the generation of the last load or unload, whether it is loaded, its config override.
DESIRED = f"{PREFIX}:{{sluice}}:desired"

#: hash: model name -> the `file:` overrides of its last load (msgpack), read only to apply it.
DESIRED_FILES = f"{PREFIX}:{{sluice}}:desired-files"

#: counter: the last generation handed out to a load or unload.
DESIRED_GENERATION = f"{PREFIX}:{{sluice}}:desired-generation"

#: pub/sub channel nudging workers to apply a new desired state now (they also look every beat).
DESIRED_CHANNEL = f"{PREFIX}:{{sluice}}:desired-events"

#: hash: fleet-wide counters kept by gateways (requests that failed before reaching a worker).
GATEWAY_STATS = f"{PREFIX}:{{sluice}}:gateway-stats"

#: Triton's logging settings set through /v2/logging or LogSettings: every process follows them.
LOG_SETTINGS = f"{PREFIX}:{{sluice}}:log-settings"

#: Triton's trace settings set through /v2/trace/setting or TraceSetting: every gateway follows
#: them (fields `global` and `model:<name>`, JSON).
TRACE_SETTINGS = f"{PREFIX}:{{sluice}}:trace-settings"


#: sorted set: id -> expiry (ms) of every asynchronous job kept, counted against --max-jobs.
JOBS_KEPT = f"{PREFIX}:{{sluice}}:jobs-kept"

#: sorted set: id -> expiry (ms) of every bulk job kept, counted against --max-bulk-jobs.
BULK_KEPT = f"{PREFIX}:{{sluice}}:bulk-kept"


#: rq queue the bulk jobs wait on (rq keeps its own keys; see shared/bulk.py).
BULK_QUEUE = "sluice-bulk"


def bulk_key(bulk_id: str, part: str) -> str:
    """A bulk job's keys (spec, input, replies, results, failed, output, lease, cancel)."""
    return f"{PREFIX}:{{bulk:{bulk_id}}}:{part}"


def bulk_fed(model: str, bulk_id: str) -> str:
    """How many items of a bulk job are on the model's stream; in the model's slot so that it
    moves in one transaction with the XADD that feeds them."""
    return f"{_model_tag(model)}:bulk-fed:{bulk_id}"


def sequence_claim(model: str, sequence_id: int | str) -> str:
    """String, with a lease: the worker that owns a sequence of a model under Triton's
    sequence batcher. Integer and string ids are kept apart (Triton's 7 and "7" differ)."""
    kind = "i" if isinstance(sequence_id, int) else "s"
    return f"{_model_tag(model)}:seq:{kind}:{sequence_id}"


def sequence_owners(model: str) -> str:
    """Sorted set: worker -> sequences it holds, of the workers serving a sequence model
    (a new sequence goes to the least loaded one that is alive)."""
    return f"{_model_tag(model)}:seq-owners"


def sequence_tag(model: str) -> str:
    """The head of a sequence model's per-worker keys, which its routing script completes with
    the owner's name (`sequence_stream`, `sequence_lease`)."""
    return _model_tag(model)


def sequence_stream(model: str, worker: str) -> str:
    """The requests of the sequences one worker owns: gateways XADD, only that worker reads."""
    return f"{_model_tag(model)}:seqs:{worker}"


def sequence_lease(model: str, worker: str) -> str:
    """String, with a lease the worker keeps renewing: it is alive and serves its sequences."""
    return f"{_model_tag(model)}:seq-alive:{worker}"


def sequence_held(model: str, worker: str) -> str:
    """Set: the claims a worker holds (`sequence_claim` keys), for a live owner to take over
    when it dies."""
    return f"{_model_tag(model)}:seq-held:{worker}"


def sequence_checkpoint(model: str, sequence_id: int | str) -> str:
    """Hash: a sequence's implicit state after its last step, that step's request id and its
    result, kept by an owner of a model with SEQUENCE_STATE_CHECKPOINT so that another worker
    can go on with the sequence if it dies."""
    kind = "i" if isinstance(sequence_id, int) else "s"
    return f"{_model_tag(model)}:seq-state:{kind}:{sequence_id}"
