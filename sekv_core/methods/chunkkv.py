"""ChunkKV: whole fixed-size chunks of the context, ranked by the question's attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .eviction import AttentionStats, EvictionMethod

CHUNK = 10  # tokens per chunk


class ChunkKV(EvictionMethod):
    """Keeps whole chunks of 10 context tokens, the same chunks for every layer and head.

    Follows "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
    Inference": the question's attention onto each context token (as SnapKV scores it, summed
    over layers and KV heads) is added up per chunk, and the best chunks stay until the budget
    is spent (the last one partly, by its first tokens). Compresses once per question.
    """

    name = "chunkkv"
    question_aware = True

    def keep(self, stats: AttentionStats) -> torch.Tensor:
        assert stats.window is not None
        length = len(self.context)
        n = -(-length // CHUNK)
        per_token = stats.window.sum(dim=(0, 1))  # (T,)
        per_chunk = F.pad(per_token, (0, n * CHUNK - length)).view(n, CHUNK).sum(dim=-1)
        order = per_chunk.argsort(descending=True, stable=True)  # (n,) best chunk first
        tokens = (order[:, None] * CHUNK + torch.arange(CHUNK)).flatten()
        tokens = tokens[tokens < length][: self.kept_tokens]
        return self.everywhere(tokens.sort().values)
