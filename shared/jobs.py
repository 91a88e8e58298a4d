"""What gateways and the SDK share about asynchronous jobs: id rules and the Lua scripts.

A job is one Redis stream (`sluice.shared.keys.job_stream`): a metadata entry, then the result
entry a worker appends when it answers the job's request.
"""

from __future__ import annotations

import re

from sluice.shared.lua import Lua

JOB_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

#: create the job stream with its metadata entry unless it exists (idempotent submission).
CREATE_JOB = Lua(
    """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('XADD', KEYS[1], '*', 'm', ARGV[1])
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
