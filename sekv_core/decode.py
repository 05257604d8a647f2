"""Greedy decoding over a model step function (shared by every method)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

Step = Callable[[torch.Tensor], torch.Tensor]
"""Feeds token ids (1, T) at the next positions; returns next-token logits (1, vocab)."""


def greedy(step: Step, prompt_ids: list[int], stop: set[int], max_new_tokens: int) -> Iterator[int]:
    """Yield greedily chosen token ids until a stop token or ``max_new_tokens``."""
    device_ids = torch.tensor([prompt_ids], dtype=torch.long)
    logits = step(device_ids)
    for _ in range(max_new_tokens):
        token = int(logits[0].argmax())
        if token in stop:
            return
        yield token
        logits = step(torch.tensor([[token]], dtype=torch.long))


class TextStream:
    """Turns a growing list of token ids into text deltas (safe across multi-byte tokens)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta
