"""A character-level language model (a one-layer GRU) served by in-flight batching.

sluice's generative contract (docs/models.md): `prefill` reads new prompts into a state with
one row per sequence, `step` produces one character for every row, and `join` / `keep`
let sequences join and leave the state between steps. The weights are trained by
examples/build_models.py on the text of Python's own `pydoc_data.topics`.

Request parameters: `temperature` (0, the default: greedy), `stop` (the character that ends
the text, "\\n" by default; "" for none); sluice itself stops at `max_tokens`.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

#: the characters the model reads and writes; any other reads as "?".
VOCABULARY = "\n" + "".join(c for c in string.printable if c.isprintable())
UNKNOWN = VOCABULARY.index("?")
INDEX = {c: i for i, c in enumerate(VOCABULARY)}


def encode(text: str) -> list[int]:
    return [INDEX.get(c, UNKNOWN) for c in text]


class CharGRU(nn.Module):
    """Characters in, the next character's logits out, with the GRU's hidden state."""

    def __init__(self, embedding: int = 32, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(VOCABULARY), embedding)
        self.gru = nn.GRU(embedding, hidden, batch_first=True)
        self.head = nn.Linear(hidden, len(VOCABULARY))

    def forward(
        self, ids: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, hidden = self.gru(self.embed(ids), hidden)
        return self.head(out), hidden


@dataclass
class State:
    """The running sequences, one row each."""

    hidden: torch.Tensor  # [1, rows, hidden]
    logits: torch.Tensor  # [rows, vocabulary]: the next character's
    temperature: torch.Tensor  # [rows]; 0: greedy
    stop: torch.Tensor  # [rows]: the stop character's index, -1: none


def _text(prompt: Any) -> str:
    raw = prompt.inputs["text_input"].reshape(-1)[0]
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


class Model:
    def __init__(self, context: Any) -> None:
        self.device = context.device
        self.net = CharGRU().to(self.device).eval()
        weights = torch.load(context.version_dir / "model.pt", map_location=self.device)
        self.net.load_state_dict(weights)

    def prompt_tokens(self, prompt: Any) -> int:
        return len(_text(prompt)) + 1

    def prefill(self, prompts: Sequence[Any]) -> State:
        # each prompt starts after a newline, as the text it learnt from: an empty one works
        ids = [torch.tensor(encode("\n" + _text(p)), device=self.device) for p in prompts]
        lengths = torch.tensor([len(i) for i in ids])
        padded = nn.utils.rnn.pad_sequence(ids, batch_first=True)
        packed = nn.utils.rnn.pack_padded_sequence(
            self.net.embed(padded), lengths, batch_first=True, enforce_sorted=False
        )
        _, hidden = self.net.gru(packed)
        temperature = [float(p.parameters.get("temperature", 0.0)) for p in prompts]
        stop = [p.parameters.get("stop", "\n") for p in prompts]
        return State(
            hidden,
            self.net.head(hidden[0]),
            torch.tensor(temperature, device=self.device),
            torch.tensor([INDEX.get(s, UNKNOWN) if s else -1 for s in stop], device=self.device),
        )

    def step(self, state: State) -> tuple[dict[str, Any], list[bool]]:
        greedy = state.logits.argmax(dim=1)
        hot = state.temperature > 0
        if bool(hot.any()):
            scaled = state.logits[hot] / state.temperature[hot, None]
            greedy[hot] = torch.multinomial(torch.softmax(scaled, dim=1), 1)[:, 0]
        logits, state.hidden = self.net(greedy[:, None], state.hidden)
        state.logits = logits[:, 0]
        chars = np.array([[VOCABULARY[i].encode()] for i in greedy.tolist()], dtype=object)
        return {"text_output": chars}, (greedy == state.stop).tolist()

    def join(self, state: State, joining: State) -> State:
        return State(
            torch.cat([state.hidden, joining.hidden], dim=1),
            torch.cat([state.logits, joining.logits]),
            torch.cat([state.temperature, joining.temperature]),
            torch.cat([state.stop, joining.stop]),
        )

    def keep(self, state: State, rows: list[int]) -> State:
        index = torch.tensor(rows, device=self.device)
        return State(
            state.hidden[:, index],
            state.logits[index],
            state.temperature[index],
            state.stop[index],
        )
