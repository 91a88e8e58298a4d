"""Where a sequence's requests go in the fleet: to the one worker that owns the sequence.

A gateway queues every request of a sequence model through `ROUTE`, one script per request,
so a sequence is claimed and its request queued in one step: the START picks the least loaded
live worker (a `sequence_owners` member whose `sequence_lease` stands), claims the sequence
for it with a lease, and `XADD`s to that worker's own stream; a later request reads the claim
and follows it; the END's routing forgets the claim, as Triton's sequence batcher forgets a
sequence once its END is queued. The owner renews its lease and its claims while it lives,
releases a sequence idle too long through `RELEASE`, and lowers its load as sequences end.
All the keys of one model share its hash tag, so a Redis Cluster runs each script on one node.
"""

from __future__ import annotations

from typing import Any

from sluice.shared import keys
from sluice.shared.errors import InvalidInput, SluiceError, Unavailable
from sluice.shared.lua import Lua
from sluice.shared.sequence_controls import SEQUENCE_END, SEQUENCE_ID, SEQUENCE_START

#: KEYS: the sequence's claim, the model's owners. ARGV: the model's key head, START, END
#: ("1" or "0"), the claim's lease (ms), the entry's fields `h` and `d`, and whether the model
#: checkpoints its sequences' state ("1": a request of a dead owner's sequence queues on its
#: stream all the same, for the live owner that takes it over; see `TAKE_OVER`).
#: Reply: {"ok", owner}, {"start"} (not started), {"lost", owner} (its owner died) or {"none"}.
ROUTE = Lua(
    """
local head = ARGV[1]
local owner = redis.call('GET', KEYS[1])
local alive = owner and redis.call('EXISTS', head .. ':seq-alive:' .. owner) == 1
if ARGV[2] == '1' then
  if not alive then
    owner = nil
    for _, worker in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
      if redis.call('EXISTS', head .. ':seq-alive:' .. worker) == 1 then
        owner = worker
        break
      end
    end
    if not owner then
      return {'none'}
    end
    redis.call('ZINCRBY', KEYS[2], 1, owner)
  end
  redis.call('SET', KEYS[1], owner, 'PX', ARGV[4])
  redis.call('SADD', head .. ':seq-held:' .. owner, KEYS[1])
elseif not owner then
  return {'start'}
elseif not alive and ARGV[7] ~= '1' then
  redis.call('DEL', KEYS[1])
  return {'lost', owner}
end
if ARGV[3] == '1' then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', head .. ':seq-held:' .. owner, KEYS[1])
end
redis.call('XADD', head .. ':seqs:' .. owner, '*', 'h', ARGV[5], 'd', ARGV[6])
return {'ok', owner}
"""
)

#: KEYS: the sequence's claim, the owner's held claims. ARGV: the owner. The owner lets a
#: sequence go (idle too long): its claim, if still its own, is deleted. Reply: 1 if it was.
RELEASE = Lua(
    """
redis.call('SREM', KEYS[2], KEYS[1])
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
)

#: KEYS: the model's owners, a dead owner's lease, its held claims, its stream, our held
#: claims, our stream. ARGV: the dead owner, us, the claims' lease (ms). A live owner of a model
#: that checkpoints its sequences' state takes a dead owner's over: the claims that are still
#: the dead one's become ours and its queued requests move, in order, to our stream, in one
#: step, so a later request of those sequences queues behind them. Reply: requests moved, or -1
#: when the owner is alive or another owner took it over first.
TAKE_OVER = Lua(
    """
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then
  return -1
end
for _, claim in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local owner = redis.call('GET', claim)
  if not owner or owner == ARGV[1] then
    redis.call('SET', claim, ARGV[2], 'PX', ARGV[3])
    redis.call('SADD', KEYS[5], claim)
  end
end
redis.call('DEL', KEYS[3])
local entries = redis.call('XRANGE', KEYS[4], '-', '+')
for _, entry in ipairs(entries) do
  redis.call('XADD', KEYS[6], '*', unpack(entry[2]))
end
redis.call('DEL', KEYS[4])
return #entries
"""
)

#: an owner's lease (ms), renewed every `RENEW_S`: once it lapses the owner counts as dead.
OWNER_LEASE_MS = 5000
#: the model parameter that has an owner keep each sequence's state in Redis after every step.
CHECKPOINT_PARAMETER = "SEQUENCE_STATE_CHECKPOINT"

#: a claim's lease (ms), renewed with the owner's: long enough to outlive a dead owner's lease
#: until a live owner took its sequences over (or answered them as lost).
CLAIM_LEASE_MS = 3 * OWNER_LEASE_MS
RENEW_S = 1.0


def route_command(
    model: str, parameters: dict[str, Any], entry: dict[str, bytes], checkpointed: bool
) -> tuple[Any, ...]:
    """The `ROUTE` call that queues one request of a sequence (its encoded entry)."""
    sequence_id = parameters[SEQUENCE_ID]
    return ROUTE.command(
        [keys.sequence_claim(model, sequence_id), keys.sequence_owners(model)],
        [
            keys.sequence_tag(model),
            int(bool(parameters.get(SEQUENCE_START))),
            int(bool(parameters.get(SEQUENCE_END))),
            CLAIM_LEASE_MS,
            entry["h"],
            entry["d"],
            int(checkpointed),
        ],
    )


def start_missing(model: str, sequence_id: int | str) -> InvalidInput:
    """Triton's error for a request of a sequence it does not know (never started, ended, or
    released when idle)."""
    return InvalidInput(
        f"inference request for sequence {sequence_id} to model '{model}' must specify the "
        "START flag on the first request of the sequence"
    )


def route_error(model: str, sequence_id: int | str, reply: Any) -> SluiceError | None:
    """What a `ROUTE` reply means for its request: None when it was queued."""
    status = _text(reply[0])
    if status == "ok":
        return None
    if status == "start":
        return start_missing(model, sequence_id)
    if status == "lost":
        return sequence_lost(model, sequence_id)
    return Unavailable(f"no worker serves sequences of model '{model}' now")


def sequence_lost(model: str, sequence_id: int | str) -> Unavailable:
    """A sequence whose worker stopped: its state went with it, so it cannot go on."""
    return Unavailable(
        f"sequence {sequence_id} of model '{model}' was lost: the worker that held its state "
        "stopped; start the sequence again"
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
