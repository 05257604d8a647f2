"""H2O: heavy hitters (most attended tokens during prefill) + a recent window."""

from __future__ import annotations

import torch

from .eviction import AttentionStats, EvictionMethod


class H2O(EvictionMethod):
    """Keeps, per layer and KV head, the tokens the context attended to most, plus recent ones.

    Follows "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
    Models": half the budget is the most recent context tokens, the other half the earlier
    tokens with the largest attention mass accumulated over every context query of the prefill
    (summed over the KV head's query heads). Chosen once after prefill, not re-evicted while
    decoding.
    """

    name = "h2o"

    def keep(self, stats: AttentionStats) -> torch.Tensor:
        length, k = len(self.context), self.kept_tokens
        recent = k // 2
        older = stats.prefill[..., : length - recent]  # (L, H_kv, T - recent)
        heavy = older.topk(k - recent, dim=-1).indices  # (L, H_kv, k - recent)
        window = torch.arange(length - recent, length).expand(*heavy.shape[:2], -1)
        return torch.cat([heavy, window], dim=-1).sort(dim=-1).values
