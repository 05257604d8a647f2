"""StreamingLLM: attention sinks + the most recent window of the context."""

from __future__ import annotations

import torch

from .eviction import AttentionStats, EvictionMethod


class StreamingLLM(EvictionMethod):
    """Keeps the attention sinks and the most recent tokens, the same for every layer and head.

    Follows "Efficient Streaming Language Models with Attention Sinks" (StreamingLLM): the first
    tokens soak up attention whatever they say, so they stay (here the prompt head and the first
    4 document tokens); the rest of the budget is the end of the context, nearest the question.
    """

    name = "streaming"

    def keep(self, stats: AttentionStats) -> torch.Tensor:
        length, sinks = len(self.context), self.sinks
        recent = self.kept_tokens - sinks
        return self.everywhere(
            torch.cat([torch.arange(sinks), torch.arange(length - recent, length)])
        )
