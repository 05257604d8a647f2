"""How the next answer token is chosen: greedy (the default, what benchmarks use), or through
transformers' logits processors — repetition penalty, temperature, top-p — with a seed.

Every method decodes through :func:`sekv_core.decode.decode_tokens`, which is given the answer's
:class:`Sampling` (None: greedy). The repetition penalty counts the answer's own tokens only (the
document is where an answer copies its names from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from .errors import ArgumentError

# A temperature below this decodes greedily: dividing the logits by it overflows float32 (at
# 1e-38 every logit is infinite and the probabilities NaN), and the distribution it would sample
# from gives the likeliest token all its mass unless another's logit is within a few thousandths.
GREEDY_BELOW = 1e-4


@dataclass(frozen=True)
class Sampling:
    """temperature 0 (or below ``GREEDY_BELOW``): greedy (top_p and seed unused);
    repetition_penalty 1: none."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ArgumentError(
                f"temperature {self.temperature} is not a finite number >= 0; pass 0 (greedy) "
                "or more"
            )
        if not 0 < self.top_p <= 1:  # False for nan too
            raise ArgumentError(f"top_p {self.top_p} is not in (0, 1]; pass e.g. 0.9")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ArgumentError(
                f"repetition_penalty {self.repetition_penalty} is not a finite number above 0 "
                "(1: none)"
            )

    @property
    def greedy(self) -> bool:
        """The likeliest token each time (a temperature of 0, or too small to divide by)."""
        return self.temperature < GREEDY_BELOW

    @property
    def plain(self) -> bool:
        """Plain greedy decoding: nothing to process."""
        return self.greedy and self.repetition_penalty == 1

    def processors(self) -> LogitsProcessorList:
        out = LogitsProcessorList()
        if self.repetition_penalty != 1:
            out.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if not self.greedy:
            out.append(TemperatureLogitsWarper(self.temperature))
            if self.top_p < 1:
                out.append(TopPLogitsWarper(self.top_p))
        return out


class Chooser:
    """Picks each next token of one answer under a :class:`Sampling`."""

    def __init__(self, sampling: Sampling) -> None:
        self.sampling, self.processors = sampling, sampling.processors()
        self.generator = torch.Generator()
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, answer: list[int]) -> int:
        """logits (1, vocab) of the next token; ``answer``: the tokens chosen so far."""
        scores = logits.float().cpu()
        if self.processors:
            ids = torch.tensor([answer], dtype=torch.long).reshape(1, -1)
            scores = self.processors(ids, scores)
        if self.sampling.greedy:
            return int(scores[0].argmax())
        probs = scores[0].softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def chooser(sampling: Sampling | None) -> Chooser | None:
    """A chooser for one answer under ``sampling``, or None for plain greedy decoding."""
    return None if sampling is None or sampling.plain else Chooser(sampling)
