"""An ensemble request on the wire: step requests with their continuation, and the join state.

A step request is an ordinary request to the composing model's stream; its continuation says
which step of which plan it is, where the ensemble's answer goes and what the client asked for.
Whoever finishes a step (a worker, or the gateway for the client's own inputs) sends each next
step fed by it alone straight to that model's stream, and answers the gateway when it fed the
answer alone. The client's inputs that later steps need travel along with each step request
(`carried`), so a chain never touches the hash. A step fed by several steps (a join) waits in
the ensemble request's hash:
`JOIN` records a producer's tensors and returns the steps it made ready, each to exactly one
producer, so a step is started once even when its producer is run again after a crash.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from sluice.shared import keys
from sluice.shared.ensemble import CLIENT, Plan
from sluice.shared.lua import Lua
from sluice.shared.protocol import Request, Result, Tensor

#: records the tensors of step ARGV[1] (ARGV[3] pairs from ARGV[4]), then for each joining
#: consumer listed after them (index, count, tensor names) returns it with its tensors once
#: all are present, to the first producer that found it ready (and to that one again).
JOIN = Lua(
    """
local key, step = KEYS[1], ARGV[1]
local i = 4
for _ = 1, tonumber(ARGV[3]) do
  redis.call('HSETNX', key, 't:' .. ARGV[i], ARGV[i + 1])
  i = i + 2
end
redis.call('PEXPIRE', key, ARGV[2])
local ready = {}
local consumers = tonumber(ARGV[i])
i = i + 1
for _ = 1, consumers do
  local consumer, count = ARGV[i], tonumber(ARGV[i + 1])
  i = i + 2
  local fields = {}
  for j = 1, count do fields[j] = 't:' .. ARGV[i + j - 1] end
  i = i + count
  local values = redis.call('HMGET', key, unpack(fields))
  local complete = true
  for j = 1, count do
    if not values[j] then complete = false end
  end
  if complete then
    local issuer = 'by:' .. consumer
    if redis.call('HSETNX', key, issuer, step) == 1 or redis.call('HGET', key, issuer) == step then
      ready[#ready + 1] = consumer
      ready[#ready + 1] = values
    end
  end
end
return ready
"""
)


@dataclass(slots=True)
class Continuation:
    """What a step request carries beyond an ordinary request."""

    plan: Plan
    step: int
    #: the gateway's reply stream, where the ensemble's answer (or first error) goes.
    reply_to: str
    #: the ensemble outputs the client asked for (None: all).
    requested: tuple[str, ...] | None
    #: each step's priority level on its model's streams (from that model's queue policy).
    levels: tuple[int, ...]
    #: how long the join state lives: the request's timeout.
    ttl_ms: int

    def encode(self) -> list[Any]:
        requested = list(self.requested) if self.requested is not None else None
        return [
            self.plan.compact(),
            self.step,
            self.reply_to,
            requested,
            list(self.levels),
            self.ttl_ms,
        ]

    @classmethod
    def decode(cls, data: list[Any]) -> Continuation:
        plan, step, reply_to, requested, levels, ttl_ms = data
        return cls(
            Plan.from_compact(plan),
            int(step),
            str(reply_to),
            tuple(requested) if requested is not None else None,
            tuple(int(level) for level in levels),
            int(ttl_ms),
        )

    def at(self, step: int) -> Continuation:
        return Continuation(
            self.plan, step, self.reply_to, self.requested, self.levels, self.ttl_ms
        )


def step_request(
    parent: Request, cont: Continuation, step: int, tensors: Mapping[str, Tensor], now_ns: int
) -> tuple[str, Request]:
    """The stream and request of step `step`, its inputs taken from the ensemble `tensors`
    (renamed to the model's input names) and its fields inherited from `parent`."""
    spec = cont.plan.steps[step]
    inputs = [_renamed(tensors[tensor], name) for name, tensor in spec.inputs.items()]
    carried = [_renamed(tensors[t], t) for t in cont.plan.carried(step, cont.requested)]
    request = Request(
        parent.id,
        spec.version,
        now_ns,
        cont.reply_to,
        inputs,
        tuple(spec.outputs),
        parent.parameters,
        cont.at(step).encode(),
        carried,
        traced=parent.traced,
        traceparent=parent.traceparent,
        model_span=parent.traced,
    )
    return keys.request_stream(spec.model, cont.levels[step]), request


def answer(request_id: str, cont: Continuation, tensors: Mapping[str, Tensor]) -> Result:
    """The ensemble's answer: the outputs the client asked for, by the ensemble's names."""
    wanted = cont.plan.needs(cont.plan.final, cont.requested)
    return Result(request_id, [_renamed(tensors[t], t) for t in wanted])


def failure(request_id: str, plan: Plan, error: tuple[str, str]) -> Result:
    """A step's error as the ensemble's answer, prefixed as Triton prefixes it."""
    code, message = error
    return Result(request_id, error=(code, f"in ensemble '{plan.name}', {message}"))


def produced(request: Request, cont: Continuation, outputs: Iterable[Tensor]) -> dict[str, Tensor]:
    """A finished step's outputs by their ensemble tensor names, with what it carried."""
    names = cont.plan.steps[cont.step].outputs
    tensors = {t.name: t for t in request.carried}
    tensors.update({names[t.name]: t for t in outputs if t.name in names})
    return tensors


def _renamed(tensor: Tensor, name: str) -> Tensor:
    return Tensor(name, tensor.datatype, tensor.shape, tensor.data)


# -- the join state ------------------------------------------------------------------------------


def pack_tensor(tensor: Tensor) -> bytes:
    return msgpack.packb([tensor.datatype, list(tensor.shape), bytes(tensor.data)])


def unpack_tensor(name: str, raw: bytes) -> Tensor:
    datatype, shape, data = msgpack.unpackb(raw)
    return Tensor(name, str(datatype), tuple(int(d) for d in shape), data)


def join_command(
    request_id: str, cont: Continuation, producer: int, tensors: Mapping[str, Tensor]
) -> tuple[Any, ...] | None:
    """The JOIN call recording what step `producer` feeds joining consumers (its outputs, and
    the client's inputs it carried); None when it feeds none."""
    plan = cont.plan
    joined = [c for c in plan.consumers(producer, cont.requested) if plan.joins(c, cont.requested)]
    if not joined:
        return None
    mine = {
        t
        for c in joined
        for t in plan.needs(c, cont.requested)
        if plan.producer(t) == producer or (plan.producer(t) == CLIENT and t in tensors)
    }
    args: list[Any] = [producer, cont.ttl_ms, len(mine)]
    for tensor in sorted(mine):
        args += [tensor, pack_tensor(tensors[tensor])]
    args.append(len(joined))
    for consumer in joined:
        needed = plan.needs(consumer, cont.requested)
        args += [consumer, len(needed), *needed]
    return JOIN.command([keys.ensemble_state(request_id)], args)


def ready_steps(cont: Continuation, reply: Sequence[Any]) -> list[tuple[int, dict[str, Tensor]]]:
    """JOIN's reply: the consumers made ready, each with the tensors it needs."""
    ready = []
    for index in range(0, len(reply), 2):
        consumer = int(reply[index])
        needed = cont.plan.needs(consumer, cont.requested)
        values = reply[index + 1]
        tensors = {t: unpack_tensor(t, raw) for t, raw in zip(needed, values, strict=True)}
        ready.append((consumer, tensors))
    return ready


def direct_consumers(cont: Continuation, producer: int) -> list[int]:
    """The steps (and the answer) fed by `producer` alone."""
    plan = cont.plan
    return [
        c for c in plan.consumers(producer, cont.requested) if not plan.joins(c, cont.requested)
    ]
