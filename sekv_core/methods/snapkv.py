"""SnapKV: the context tokens the question attends to, pooled so neighbours come along."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .eviction import AttentionStats, EvictionMethod

KERNEL = 7  # 1-D max pool over positions: a kept token brings its 3 neighbours on each side


class SnapKV(EvictionMethod):
    """Keeps, per layer and KV head, the context tokens the question's tokens attend to most.

    Follows "SnapKV: LLM Knows What You are Looking for Before Generation": the observation
    window is the question part of the prompt (template + question), its attention onto the
    context (summed over its queries and the KV head's query heads) is max-pooled over
    positions (kernel 7) and the top ``k`` tokens stay. Compresses once per question from the
    full prefill kept on the side; the question itself is then re-read over the compressed cache.
    """

    name = "snapkv"
    question_aware = True

    def keep(self, stats: AttentionStats) -> torch.Tensor:
        assert stats.window is not None
        L, H, T = stats.window.shape
        flat = stats.window.reshape(L * H, 1, T)
        pooled = F.max_pool1d(flat, KERNEL, stride=1, padding=KERNEL // 2).view(L, H, T)
        return pooled.topk(self.kept_tokens, dim=-1).indices.sort(dim=-1).values
