"""Static semantic memory (SentenceKV-like): spans fixed at prefill, never zoomed.

The context is cut into spans by the same entropy segmentation and span store SeKV uses, but
answering attends, in one softmax, to the sinks + anchors, ONE summary entry per span (its logit
gets + log|S|, so that it weighs like |S| similar tokens) and the local window (question +
answer tokens): nothing is reconstructed while answering. The summaries (surprisal-weighted mean
key, mean value: :func:`summarize`) are computed once from the store's offload
tier when the method is prepared; the offload tier is not read again, so it does not count as
this method's memory, and neither does the routing sketch (never read).

Its memory is fixed by the segmentation: it cannot follow ``memory_share`` or ``budget``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from transformers import DynamicCache

from ..backend import use_attention
from ..decode import Forcing, PositionedStep, decode_tokens
from ..kvquant import STORE_DTYPE
from ..prompt import stop_ids
from ..sampling import Sampling
from ..segment import SPAN
from ..zoom.attention import mixed_attention
from ..zoom.memory import SpanMemory
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


def store_summaries(
    spans: SpanMemory, trace: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every span's summary K (at the span's centre) and V, (L, H, N, D) each on the device,
    from the offload tier's rows of every span and head (keys pre-RoPE) and the span tokens'
    surprisal (``trace``)."""
    N, H, D = spans.n_spans, spans.num_kv_heads, spans.head_dim
    lengths, first = spans.lengths.cpu(), spans.first_row
    spans_all, heads = torch.arange(N).repeat(H), torch.arange(H).repeat_interleave(N)

    def blocks(x: torch.Tensor) -> torch.Tensor:  # rows (..., S, D) -> spans (..., N, M, D)
        return gather_spans(x, first, first + lengths)

    surprisal = trace["surprisal"][trace["roles"] == SPAN].float()  # (S,) in row order
    weights = blocks(surprisal[:, None])[..., 0]
    out_k, out_v = [], []
    for layer in range(spans.num_layers):
        # every pair, head-major; keys pre-RoPE
        k, v = (x.float().cpu() for x in spans.reconstruct(layer, spans_all, heads, rotate=False))
        summary_k, summary_v = summarize(
            blocks(k.view(H, -1, D)), blocks(v.view(H, -1, D)), weights, lengths
        )
        out_k.append(summary_k)
        out_v.append(summary_v)
    centres = (spans.starts + spans.ends - 1) // 2
    summary_k = spans.rope.rotate(torch.stack(out_k), centres)  # (L, H, N, D)
    device = spans.device
    return summary_k.to(device, STORE_DTYPE), torch.stack(out_v).to(device, STORE_DTYPE)


class StaticSemantic(SeKV):
    name = "static"
    follows_memory_share = False  # its memory is fixed by the segmentation
    reads_books = False  # its attention has no bounded-position path

    answered: bool = False

    def prepare(self, progress: Progress | None = None) -> None:
        super().prepare(progress)
        self.summary_k, self.summary_v = store_summaries(self.spans, self.store.trace)

    def uses_trained_router(self) -> bool:
        return False  # nothing is routed: every span is read as its summary

    def generate(
        self,
        question_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling | None = None,
        forcing: Forcing | None = None,
    ) -> Iterator[int]:
        model, device = self.loaded.model, self.loaded.device
        self.answered = True
        local = DynamicCache(config=model.config)
        start = len(self.context)  # local tokens continue after the document's positions
        self.step = step = PositionedStep(model, local, start, device, sekv_static=self)
        with use_attention(model, NAME, static_attention_forward):
            stop = stop_ids(self.loaded.tokenizer)
            yield from decode_tokens(step, question_ids, stop, max_new_tokens, sampling, forcing)

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
            "offloaded_bytes": 0,  # the store's records exist on disk but are not read
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


def gather_spans(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Zero-padded span blocks: (..., T, D) -> (..., N, M, D) with M the longest span."""
    lengths = ends - starts
    width = int(lengths.max()) if len(lengths) else 0
    pos = starts[:, None] + torch.arange(width)[None]  # (N, M)
    valid = torch.arange(width)[None] < lengths[:, None]  # (N, M)
    blocks = x[..., pos.clamp(max=x.shape[-2] - 1), :]  # (..., N, M, D)
    return blocks * valid[..., None].to(x.dtype)


def summarize(
    keys: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Span summaries from padded blocks.

    keys, values : (..., N, M, D) padded span blocks; weights : (N, M) surprisal (0 on padding)
    Returns the surprisal-weighted mean key, rescaled to the span's mean key norm, and the mean
    value, each (..., N, D).
    """
    valid = (torch.arange(keys.shape[-2])[None] < lengths[:, None]).to(keys.dtype)  # (N, M)
    w = weights.clamp(min=0) * valid
    w = torch.where(w.sum(-1, keepdim=True) > 0, w, valid)
    w = w / w.sum(-1, keepdim=True)  # (N, M)
    mean_k = (w[..., None] * keys).sum(-2)  # (..., N, D)
    mean_norm = (keys.norm(dim=-1) * valid).sum(-1) / lengths.to(keys.dtype)  # (..., N)
    summary_k = mean_k * (mean_norm / mean_k.norm(dim=-1).clamp(min=1e-6))[..., None]
    summary_v = values.sum(-2) / lengths.to(values.dtype)[:, None]
    return summary_k, summary_v
