"""Teacher signals: what the frozen full-KV model does, that the router learns to reproduce.

The question + answer tokens run over the document's full KV cache; per layer and query head,
the attention mass each span receives at every one of those positions is summed span by span as
each layer is computed (one layer's (heads x queries x context) map at a time, never all layers'
maps), and the next-token log-probabilities at the answer positions are kept. Positions whose
span mass is >= ``MINE_MASS`` are *mined*: their zoom targets are the fewest spans holding
``rho`` of it (:func:`zoom_targets`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..backend import use_attention
from ..methods.full import answer_over, truncate
from ..models import LoadedModel
from ..zoom.memory import SpanMemory

TEACHER = "sekv_teacher"
MINE_MASS = 0.05  # a position "reaches far back" when >= this share of its attention is on spans


@dataclass
class TeacherTrace:
    """Filled by the teacher pass: span mass per layer, (Hq, Tq, N) each."""

    span_of_token: torch.Tensor  # (T,) span index of each context token, N for sinks/anchors
    n_spans: int
    mass: list[torch.Tensor] = field(default_factory=list)


def causal_local(q_len: int, local_len: int, device) -> torch.Tensor:
    """(Tq, Tl) visibility of local keys for the last Tq of Tl local positions."""
    cols = torch.arange(local_len, device=device)[None]
    rows = torch.arange(local_len - q_len, local_len, device=device)[:, None]
    return cols <= rows


def teacher_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sekv_teacher=None, **_
):
    """Plain causal attention over [context | new tokens] that also sums span mass per head."""
    trace: TeacherTrace = sekv_teacher
    _, Hq, Tq, D = query.shape
    Hkv, Tl = key.shape[1], key.shape[2]
    T = Tl - Tq  # context tokens in the cache
    scaling = scaling if scaling is not None else D**-0.5
    k = key[0].repeat_interleave(Hq // Hkv, dim=0)  # (Hq, Tl, D)
    v = value[0].repeat_interleave(Hq // Hkv, dim=0)
    logits = torch.einsum("htd,hsd->hts", query[0], k).float() * scaling
    visible = torch.ones(Tq, Tl, dtype=torch.bool, device=query.device)
    visible[:, T:] = causal_local(Tq, Tq, query.device)
    probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    mass = probs.new_zeros(Hq, Tq, trace.n_spans + 1)
    mass.index_add_(2, trace.span_of_token, probs[..., :T])
    trace.mass.append(mass[..., :-1])
    out = torch.einsum("hts,hsd->htd", probs.to(v.dtype), v)
    return out.transpose(0, 1)[None].contiguous(), None


def span_tokens(memory: SpanMemory) -> torch.Tensor:
    """(S,) context positions of the span tokens, span by span."""
    return torch.cat(
        [torch.arange(int(s), int(e)) for s, e in zip(memory.starts, memory.ends, strict=True)]
    )


@torch.inference_mode()
def teacher_pass(
    loaded: LoadedModel,
    cache: DynamicCache,
    memory: SpanMemory,
    context_len: int,
    ids: list[int],
    answer_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run question + answer ``ids`` over the document's full ``cache``.

    Returns the log-probs of the answer positions (Ta, V) and the span mass (L, Hq, Tq, N) of
    every position, on the CPU; the cache is left holding the document alone.
    """
    model = loaded.model
    span_of = torch.full((context_len,), memory.n_spans, dtype=torch.long)
    span_of[span_tokens(memory)] = memory.sketch_span.cpu()
    trace = TeacherTrace(span_of.to(loaded.device), memory.n_spans)
    try:
        with use_attention(model, TEACHER, teacher_attention):
            out = model(
                input_ids=torch.tensor([ids], device=loaded.device),
                cache=cache,
                use_cache=True,
                logits_to_keep=answer_len + 1,
                sekv_teacher=trace,
            )
    finally:
        truncate(cache, context_len)
    logp = out.logits[0, :-1].float().log_softmax(-1).cpu()
    return logp, torch.stack(trace.mass).cpu()


def teacher_answer(
    loaded: LoadedModel, cache: DynamicCache, context_len: int, question: list[int], limit: int
) -> list[int]:
    """The full-KV model's own greedy answer to ``question`` (up to ``limit`` tokens); the
    cache is left holding the document alone."""
    try:
        return list(answer_over(loaded, cache, question, limit))
    finally:
        truncate(cache, context_len)


def zoom_targets(mass: torch.Tensor, rho: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mined positions and their targets from teacher span mass (..., N).

    Returns mined (...,) bool — positions putting >= MINE_MASS of attention on spans — and
    targets (..., N) bool: the fewest spans holding ``rho`` of each position's span mass.
    """
    total = mass.sum(-1)
    order = mass.argsort(-1, descending=True)
    sorted_mass = mass.gather(-1, order)
    before = sorted_mass.cumsum(-1) - sorted_mass  # mass of the better spans
    take = before < rho * total[..., None]
    targets = torch.zeros_like(take).scatter(-1, order, take)
    return total >= MINE_MASS, targets
