"""Static semantic memory (SentenceKV-like): spans fixed at prefill, never zoomed.

The context is cut into spans by the same entropy segmentation and span store SeKV uses, but
answering attends, in one softmax, to the sinks + anchors, ONE summary entry per span (its logit
gets + log|S|, so that it weighs like |S| similar tokens) and the local window (question +
answer tokens): nothing is ever reconstructed. The offload tier (the bases) is never read, so
it does not count as this method's memory, and neither does the routing sketch (never read).

Its memory is fixed by the segmentation: it cannot follow ``memory_share`` or ``budget``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from transformers import DynamicCache

from ..attention import mixed_attention
from ..backend import use_attention
from ..decode import PositionedStep, greedy
from ..prompt import stop_ids
from .base import Progress
from .sekv import SeKV

NAME = "sekv_static"


def static_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sekv_static: StaticSemantic | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (1, Hq, Tq, D), key/value (1, Hkv, Tl, D) local;
    memory entries: sinks + anchors, then one summary per span."""
    if sekv_static is None:
        raise RuntimeError("static attention called without sekv_static")
    layer, method = module.layer_idx, sekv_static
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    _, Hq, Tq, D = query.shape
    Hkv = key.shape[1]
    q = query[0].view(Hkv, Hq // Hkv, Tq, D)  # (Hkv, G, Tq, D)
    fixed_k, fixed_v = method.spans.fixed_kv(layer, q.dtype)  # (Hkv, F, D)
    summary_k, summary_v = method.summary_k[layer], method.summary_v[layer]  # (Hkv, N, D)
    k_mem = torch.cat([fixed_k, summary_k.to(q.dtype)], dim=1)
    v_mem = torch.cat([fixed_v, summary_v.to(q.dtype)], dim=1)
    log_len = method.spans.log_len[None].float().expand(Hkv, -1)  # (Hkv, N)
    bias = torch.cat([log_len.new_zeros(Hkv, fixed_k.shape[1]), log_len], dim=1)
    out, _ = mixed_attention(q, key[0], value[0], k_mem, v_mem, bias, scaling)
    return out.reshape(Hq, Tq, D).transpose(0, 1)[None].contiguous(), None


class StaticSemantic(SeKV):
    name = "static"
    follows_memory_share = False  # its memory is fixed by the segmentation
    reads_books = False  # its attention has no bounded-position path

    answered: bool = False

    def prepare(self, progress: Progress | None = None) -> None:
        super().prepare(progress)
        r, device = self.store.resident, self.loaded.device
        self.summary_k = r["summary_k"].to(device)  # (L, H, N, D) at each span's centre
        self.summary_v = r["summary_v"].to(device)

    def generate(self, question_ids: list[int], max_new_tokens: int) -> Iterator[int]:
        model, device = self.loaded.model, self.loaded.device
        self.answered = True
        local = DynamicCache(config=model.config)
        start = len(self.context)  # local tokens continue after the document's positions
        self.step = step = PositionedStep(model, local, start, device, sekv_static=self)
        with use_attention(model, NAME, static_attention_forward):
            yield from greedy(step, question_ids, stop_ids(self.loaded.tokenizer), max_new_tokens)

    def read_tensors(self) -> list[torch.Tensor]:
        """What attention reads every step: sinks + anchors K/V, summaries, span lengths."""
        s = self.spans
        fixed = [*s.fixed[0].tensors(), *s.fixed[1].tensors()]
        return [*fixed, self.summary_k, self.summary_v, s.lengths, s.log_len]

    def memory(self) -> dict[str, int]:
        fp16 = sum(
            t.numel() * (2 if t.is_floating_point() else t.element_size())
            for t in self.read_tensors()
        )
        return {
            "resident_bytes": fp16,
            "resident_tier_bytes": fp16,
            "zoom_peak_bytes": 0,
            "local_window_bytes": self.loaded.spec.kv_bytes(self.local_tokens, 2),
            "offloaded_bytes": 0,  # the store's bases exist on disk but are never read
        }

    def zoom_trace(self) -> list[dict[str, Any]]:
        return []

    def routing(self) -> dict[str, Any]:
        if not self.answered:
            return {}
        return {
            "router": "none",
            "spans": self.spans.n_spans,
            "fixed_tokens": self.spans.fixed_tokens,
            "reconstructions": 0,
        }
