"""What gateways and the SDK share about asynchronous jobs: id rules, request digests and the
Lua scripts.

A job is one Redis stream (`sluice.shared.keys.job_stream`): a metadata entry, then the result
entry a worker appends when it answers the job's request. A client's job id is an idempotency
key: the metadata entry keeps a digest of the request, so that the same id sent again with the
same request finds its job, and with another request is refused.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from sluice.shared.lua import Lua
from sluice.shared.protocol import Tensor

JOB_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
#: --max-jobs' default: jobs kept fleet-wide at once (each for --job-ttl), far past normal use.
MAX_JOBS = 1_000_000
#: --max-bulk-jobs' default: bulk jobs kept fleet-wide at once (each for its TTL, a day unless
#: told otherwise), far past normal use.
MAX_BULK_JOBS = 1_000

#: create the job stream with its metadata entry and request digest unless it exists: 1 made,
#: 0 there already for the same request (or one kept without a digest), -1 for another request.
CREATE_JOB = Lua(
    """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
  local fields = first and first[2] or {}
  for i = 1, #fields, 2 do
    if fields[i] == 'r' then
      if fields[i + 1] == ARGV[3] then return 0 end
      return -1
    end
  end
  return 0
end
redis.call('XADD', KEYS[1], '*', 'm', ARGV[1], 'r', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""
)

#: answer a job with `cancelled` unless a result is already there.
CANCEL_JOB = Lua(
    """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('XLEN', KEYS[1]) > 1 then return 0 end
redis.call('XADD', KEYS[1], '*', 'h', ARGV[1], 'd', ARGV[2])
return 1
"""
)

#: count an id among those kept (KEYS[1], a sorted set scored by expiry in ms) for ARGV[2]
#: seconds, unless ARGV[3] (> 0) are kept already: 1 counted now, 2 counted before, 0 refused.
HOLD_QUOTA = Lua(
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 2 end
local limit = tonumber(ARGV[3])
if limit > 0 and redis.call('ZCARD', KEYS[1]) >= limit then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]) * 1000, ARGV[1])
return 1
"""
)


def request_digest(
    model: str,
    version: str,
    inputs: Sequence[Tensor],
    parameters: Mapping[str, Any],
    outputs: Mapping[str, Any] | None,
) -> str:
    """What makes two submissions under one job id the same request: the model and version as
    named, the inputs (by name, however they were encoded), parameters and outputs asked for."""
    ordered = sorted(inputs, key=lambda tensor: tensor.name)
    head = {
        "model": model,
        "version": version,
        "inputs": [(t.name, t.datatype, list(t.shape), memoryview(t.data).nbytes) for t in ordered],
        "parameters": parameters,
        "outputs": outputs,
    }
    digest = hashlib.blake2b(orjson.dumps(head, option=orjson.OPT_SORT_KEYS, default=str))
    for tensor in ordered:
        digest.update(tensor.data)
    return digest.hexdigest()


def conflict_message(job_id: str) -> str:
    """A job id sent again with another request: every path that makes jobs words it so."""
    return (
        f"job '{job_id}' already exists for another request (model, version, inputs, "
        "parameters or outputs differ): give each request its own id"
    )


def quota_message(what: str, limit: int, option: str) -> str:
    """A submission refused because `limit` of `what` are kept already."""
    return f"too many {what}: {limit} are kept already ({option}); try again once some have expired"
