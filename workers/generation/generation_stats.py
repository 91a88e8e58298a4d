"""What generation adds to a model's statistics, named as LLM servers name it.

Time to first token (from the request's arrival at the gateway) and inter-token latency go
into histograms with the latency buckets of the queue and request histograms; prompt and
generated tokens are counted; the running and waiting sequences are the latest seen. The
counts accumulate here and leave as increments of the model's statistics hash (shared/stats.py),
so every worker adds to the same figures.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from sluice.shared.protocol import Request
from sluice.shared.stats import (
    GENERATION_TOKENS,
    ITL,
    ITL_SUM,
    PROMPT_TOKENS,
    TTFT,
    TTFT_SUM,
    failure_increments,
    histogram_increments,
)


@dataclass(slots=True)
class _Version:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft_ns: list[int] = field(default_factory=list)
    itl_ns: list[int] = field(default_factory=list)
    #: Triton's figures: an iteration is an execution of its running sequences.
    batch_sizes: Counter[int] = field(default_factory=Counter)
    success_ns: list[int] = field(default_factory=list)
    failures: Counter[str] = field(default_factory=Counter)


@dataclass(slots=True)
class GenerationStats:
    """One model queue's generation figures since they were last taken."""

    running: int = 0
    waiting: int = 0
    _versions: defaultdict[int, _Version] = field(default_factory=lambda: defaultdict(_Version))

    def sequences(self, running: int, waiting: int) -> None:
        self.running, self.waiting = running, waiting

    def iteration(self, version: int, size: int) -> None:
        """An iteration stepped `size` sequences (Triton: one execution, `size` inferences)."""
        self._versions[version].batch_sizes[size] += 1

    def finished(self, request: Request, now_ns: int) -> None:
        """`request` ended with its last token at `now_ns` (Triton: a success)."""
        self._versions[request.version].success_ns.append(max(0, now_ns - request.enqueue_ns))

    def failed(self, version: int, reason: str) -> None:
        """A sequence ended with an error (Triton's failure reason: BACKEND, CANCELED)."""
        self._versions[version].failures[reason] += 1

    def prompt_tokens(self, version: int, count: int) -> None:
        self._versions[version].prompt_tokens += count

    def token(self, request: Request, now_ns: int, previous_ns: int) -> None:
        """A token of `request` went out at `now_ns` (`previous_ns`: its last one, 0 if none)."""
        figures = self._versions[request.version]
        figures.generation_tokens += 1
        if previous_ns:
            figures.itl_ns.append(max(0, now_ns - previous_ns))
        else:
            figures.ttft_ns.append(max(0, now_ns - request.enqueue_ns))

    def take_increments(self) -> list[str | int]:
        """The figures gathered since the last call, as statistics increments (the histograms'
        per-bucket counts under "ht"/"hi", their sums under "ttft_ns"/"itl_ns")."""
        pairs: list[str | int] = []
        for v, figures in self._versions.items():
            for name, count in (
                (PROMPT_TOKENS, figures.prompt_tokens),
                (GENERATION_TOKENS, figures.generation_tokens),
                (TTFT_SUM, sum(figures.ttft_ns)),
                (ITL_SUM, sum(figures.itl_ns)),
            ):
                if count:
                    pairs += [f"{v}:{name}", count]
            pairs += histogram_increments(f"{v}:{TTFT}", figures.ttft_ns)
            pairs += histogram_increments(f"{v}:{ITL}", figures.itl_ns)
            pairs += _triton_increments(v, figures)
        self._versions.clear()
        return pairs


def _triton_increments(v: int, figures: _Version) -> list[str | int]:
    """Executions, inferences, batch sizes, successes and failures, as batches count them."""
    sizes = figures.batch_sizes
    pairs: list[str | int] = []
    if sizes:
        pairs += [f"{v}:execution_count", sizes.total()]
        pairs += [f"{v}:inference_count", sum(size * n for size, n in sizes.items())]
        for size, n in sizes.items():
            pairs += [f"{v}:b{size}:count", n]
    if figures.success_ns:
        pairs += [f"{v}:success_count", len(figures.success_ns)]
        pairs += [f"{v}:success_ns", sum(figures.success_ns)]
        pairs += histogram_increments(f"{v}:hr", figures.success_ns)
    for reason, count in figures.failures.items():
        pairs += failure_increments(v, reason, count)
    return pairs
