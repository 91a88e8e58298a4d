"""Generation on one instance: sequences join and leave between steps, one response per token,
the last one final; failures and cancellations end only the sequences they concern."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sluice.shared.errors import ModelExecutionError, SluiceError
from sluice.shared.model_config import load_model_config
from sluice.shared.protocol import Request, Tensor
from sluice.workers.generation.generation import Generation
from sluice.workers.generation.generation_stats import GenerationStats
from sluice.workers.generation.inflight import InflightScheduler, Limits
from sluice.workers.instances.model_instance import GenerativeModel

from tests.charlm import build_charlm, greedy_texts
from tests.counter_model import CONFIG, SPEC_DIR, Counter, request


@dataclass
class Sent:
    """What the generation sent, in order: (request id, token or error code, final)."""

    log: list[tuple[str, int | str, bool]] = field(default_factory=list)
    #: the requests whose client went away.
    cancelled: set[str] = field(default_factory=set)

    def send_tensors(
        self,
        request: Request,
        tensors: Sequence[Tensor],
        error: SluiceError | None = None,
        final: bool = False,
    ) -> None:
        if error is not None:
            self.log.append((request.id, error.code, final))
            return
        (token,) = tensors
        assert token.shape == (1, 1)
        value = int(np.frombuffer(token.data, dtype=np.int32)[0])
        self.log.append((request.id, value, final))

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self.cancelled

    def end(self, request: Request, error: SluiceError) -> bool:
        self.send_tensors(request, [], error, final=True)
        return True

    def of(self, request_id: str) -> list[tuple[int | str, bool]]:
        return [(value, final) for rid, value, final in self.log if rid == request_id]


async def inline(call: Callable[[], Any]) -> Any:
    return call()


def generation(
    tmp_path: Path, model: GenerativeModel, max_sequences: int = 2, **kw: Any
) -> tuple[Generation, Sent]:
    (tmp_path / SPEC_DIR).mkdir(exist_ok=True)
    (tmp_path / SPEC_DIR / "config.pbtxt").write_text(CONFIG)
    spec = load_model_config(tmp_path / SPEC_DIR)
    sent = Sent()
    scheduler: InflightScheduler[Request] = InflightScheduler(Limits(max_sequences))
    return Generation(spec, model, scheduler, sent, run=inline, **kw), sent


def run_until_idle(gen: Generation) -> int:
    iterations = 0
    while not gen.scheduler.idle:
        asyncio.run(gen.iterate())
        iterations += 1
    return iterations


def test_a_short_request_joins_while_long_ones_run_and_finishes_first(tmp_path: Path) -> None:
    gen, sent = generation(tmp_path, Counter(), max_sequences=2)
    gen.submit(request("long", 6))
    gen.submit(request("short-1", 2))
    gen.submit(request("short-2", 2))  # waits for short-1's slot, not for long
    run_until_idle(gen)
    assert sent.of("long") == [(n, n == 6) for n in range(1, 7)]
    assert sent.of("short-2") == [(1, False), (2, True)]
    finals = [rid for rid, _, final in sent.log if final]
    assert finals == ["short-1", "short-2", "long"]
    # short-2 took short-1's slot at the very next iteration
    assert [rid for rid, value, _ in sent.log if value == 1][2] == "short-2"
    assert sent.log.index(("short-2", 1, False)) == sent.log.index(("short-1", 2, True)) + 2


def test_max_tokens_ends_a_sequence_early_with_a_final_token(tmp_path: Path) -> None:
    gen, sent = generation(tmp_path, Counter())
    gen.submit(request("capped", 100, max_tokens=3))
    run_until_idle(gen)
    assert sent.of("capped") == [(1, False), (2, False), (3, True)]


def test_the_model_parameter_max_tokens_is_the_default(tmp_path: Path) -> None:
    gen, sent = generation(tmp_path, Counter())
    gen.spec.parameters["MAX_TOKENS"] = "2"
    gen.submit(request("a", 100))
    run_until_idle(gen)
    assert sent.of("a") == [(1, False), (2, True)]


def test_a_bad_max_tokens_is_refused_before_it_joins(tmp_path: Path) -> None:
    gen, _ = generation(tmp_path, Counter())
    with pytest.raises(Exception, match="max_tokens"):
        gen.submit(request("a", 3, max_tokens=0))
    assert gen.scheduler.idle


def test_cancelling_a_running_sequence_ends_it_and_frees_its_slot(tmp_path: Path) -> None:
    gen, sent = generation(tmp_path, Counter(), max_sequences=1)
    gen.submit(request("a", 50))
    gen.submit(request("b", 1))
    asyncio.run(gen.iterate())
    sent.cancelled.add("a")
    run_until_idle(gen)
    assert sent.of("a") == [(1, False), ("CANCELLED", True)]
    assert sent.of("b") == [(1, True)]


def test_cancelling_a_waiting_sequence_answers_it_at_once(tmp_path: Path) -> None:
    gen, sent = generation(tmp_path, Counter(), max_sequences=1)
    gen.submit(request("a", 2))
    gen.submit(request("b", 2))
    sent.cancelled.add("b")
    asyncio.run(gen.iterate())
    assert sent.of("b") == [("CANCELLED", True)]
    run_until_idle(gen)
    assert sent.of("a") == [(1, False), (2, True)]


def test_a_failing_prefill_fails_only_the_joining_sequences(tmp_path: Path) -> None:
    model = Counter()
    gen, sent = generation(tmp_path, model, max_sequences=2)
    gen.submit(request("running", 3))
    asyncio.run(gen.iterate())
    model.fail_prefill_at = 7
    gen.submit(request("bad", 7))
    run_until_idle(gen)
    assert sent.of("bad") == [("INTERNAL", True)]
    assert sent.of("running") == [(1, False), (2, False), (3, True)]


def test_a_failing_step_fails_every_running_sequence_and_the_next_start_afresh(
    tmp_path: Path,
) -> None:
    model = Counter()
    gen, sent = generation(tmp_path, model, max_sequences=2)
    gen.submit(request("a", 5))
    gen.submit(request("b", 5))
    asyncio.run(gen.iterate())
    model.fail_step = True
    asyncio.run(gen.iterate())
    model.fail_step = False
    gen.submit(request("c", 1))
    run_until_idle(gen)
    assert sent.of("a")[-1] == sent.of("b")[-1] == ("INTERNAL", True)
    assert sent.of("c") == [(1, True)]


def test_a_failing_join_fails_the_running_and_the_joining_sequences(tmp_path: Path) -> None:
    model = Counter()
    gen, sent = generation(tmp_path, model, max_sequences=2)
    gen.submit(request("a", 5))
    asyncio.run(gen.iterate())
    model.fail_join = True
    gen.submit(request("b", 5))
    run_until_idle(gen)
    assert sent.of("a")[-1] == sent.of("b")[-1] == ("INTERNAL", True)
    assert gen.state is None


def test_a_failing_prompt_count_refuses_that_request_alone(tmp_path: Path) -> None:
    model = Counter()
    model.prompt_tokens = lambda prompt: 1 // 0  # type: ignore[attr-defined]
    gen, _ = generation(tmp_path, model)
    with pytest.raises(ModelExecutionError, match="by zero"):
        gen.submit(request("a", 3))
    assert gen.scheduler.idle


def test_time_to_first_token_inter_token_latency_and_token_counts(tmp_path: Path) -> None:
    ticks = itertools.count(start=2_000_000, step=1_000_000)  # 1 ms per step
    stats = GenerationStats()
    gen, _ = generation(tmp_path, Counter(), stats=stats, clock_ns=lambda: next(ticks))
    gen.submit(request("a", 3))  # enqueued at 0: first token at 2 ms
    run_until_idle(gen)
    increments = stats.take_increments()
    figures = dict(zip(increments[::2], increments[1::2], strict=True))
    assert figures["1:generation_tokens"] == 3
    assert figures["1:prompt_tokens"] == 1
    assert figures["1:ttft_ns"] == 2_000_000
    assert figures["1:itl_ns"] == 2_000_000  # two gaps of 1 ms
    # 2 ms falls in the (1 ms, 2.5 ms] bucket (index 2), 1 ms in (0.5 ms, 1 ms] (index 1)
    assert (figures["1:ht2"], figures["1:hi1"]) == (1, 2)
    # as Triton counts: every iteration one execution of its sequences, the request a success
    assert (figures["1:execution_count"], figures["1:inference_count"]) == (3, 3)
    assert (figures["1:success_count"], figures["1:success_ns"]) == (1, 4_000_000)
    assert stats.take_increments() == []


def test_failures_are_counted_by_reason(tmp_path: Path) -> None:
    model = Counter()
    stats = GenerationStats()
    gen, sent = generation(tmp_path, model, stats=stats)
    gen.submit(request("a", 5))
    asyncio.run(gen.iterate())
    sent.cancelled.add("a")
    model.fail_prefill_at = 9
    gen.submit(request("b", 9))
    run_until_idle(gen)
    increments = stats.take_increments()
    figures = dict(zip(increments[::2], increments[1::2], strict=True))
    assert (figures["1:failure:CANCELED"], figures["1:failure:BACKEND"]) == (1, 1)
    assert "1:success_count" not in figures


@pytest.fixture(scope="module")
def charlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_charlm(tmp_path_factory.mktemp("repo"))


def generate(model_dir: Path, prompts: dict[str, str], max_sequences: int) -> dict[str, str]:
    return greedy_texts(model_dir, prompts, max_sequences, max_tokens=40, stop="")


def test_charlm_generates_the_same_text_greedily_alone_or_batched(charlm: Path) -> None:
    prompts = {"a": "The ", "b": "A class definition", "c": ""}
    alone = {rid: generate(charlm, {rid: p}, 1)[rid] for rid, p in prompts.items()}
    assert alone == {rid: generate(charlm, {rid: p}, 1)[rid] for rid, p in prompts.items()}
    assert all(len(text) == 40 for text in alone.values())
    # two slots for three prompts: c joins when a slot frees, mid-way through the others' state
    assert generate(charlm, prompts, 2) == alone
