"""Triton's `max_queue_size`, kept exact fleet-wide by one script every producer goes through.

A bounded priority level has a counter (`keys.queue_sizes`) that this script raises as it
queues each request and the worker's finishing script (shared/stats.py) lowers as it answers
one. A request queued on a bounded level any other way is still answered, and lowered, so the
counter would drift below the real queue and admission would grow lenient: infer, jobs over
HTTP and jobs submitted straight to Redis all queue through here. Bulk jobs raise the counter
by what they feed, within a window under the limit (workers/bulk.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sluice.shared import keys
from sluice.shared.lua import Lua

#: admit each request while its priority level's queue has room; report which were admitted.
#: KEYS: the level's request stream, the model's queue-size hash. ARGV: level, limit, then
#: each request's entry fields `h` and `d`.
ENQUEUE = Lua(
    """
local size = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
local limit = tonumber(ARGV[2])
local admitted = {}
for i = 3, #ARGV, 2 do
  if size < limit then
    redis.call('XADD', KEYS[1], '*', 'h', ARGV[i], 'd', ARGV[i + 1])
    size = size + 1
    admitted[#admitted + 1] = 1
  else
    admitted[#admitted + 1] = 0
  end
end
redis.call('HSET', KEYS[2], ARGV[1], size)
return admitted
"""
)


def enqueue_command(
    model: str, level: int, max_queue_size: int, entries: Sequence[Mapping[str, bytes]]
) -> tuple[object, ...]:
    """The script call queuing one-request `entries` while the level has room (replies 1/0
    per entry); only for a level with a `max_queue_size`."""
    args: list[int | bytes] = [level, max_queue_size]
    for entry in entries:
        args += [entry["h"], entry["d"]]
    return ENQUEUE.command([keys.request_stream(model, level), keys.queue_sizes(model)], args)


def queue_full(request_id: str) -> str:
    """Triton's message for a request refused by `max_queue_size` (a 503)."""
    return f"[request id: {request_id}] Exceeds maximum queue size"
