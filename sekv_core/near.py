"""Near spans: the spans ranked just below the zoom join the softmax at span resolution.

A zoom decision splits the spans in two: zoomed (token-level K/V reconstructed) and the rest,
whose attention is dropped. Dropping it hands the zoomed tokens all the weight the other spans
would have had: with more zoom, answers drift to a zoomed filler sentence instead of the one the
question asked about. Measured (docs/benchmarks.md, ninth pass): giving *every* unzoomed span its
share back (its mean value, weighted by its estimated attention) fixed those answers, if each
span's mean value could be read; one mean value for all of them made answers worse.

So a third resolution sits between the two: the ``near`` spans, the best-scoring spans the zoom
left out, as many as ``share`` x the zoom budget's worth of tokens, enter the softmax together as
one entry per query head and query:

    logit = log sum over their tokens of exp(estimated logit)   (the resident sketch's estimates)
    value = sum over the spans of (their share of that mass) x (the span's mean value)

equal to one entry per span whose logit is the log-sum-exp of its tokens' estimated logits. The
mean values come from the store's span summaries on the host, gathered for the near spans only
(per layer and call: one value row per span and KV head; counted with the zoom's memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .sketch import sketch_logits

if TYPE_CHECKING:
    from .zoom import SpanMemory


def near_count(share: float, budget: int, mean_length: float) -> int:
    """How many near spans a KV head takes: ``share`` x ``budget`` tokens' worth of spans."""
    if share <= 0 or budget <= 0 or mean_length <= 0:
        return 0
    return max(1, int(share * budget / mean_length))


def near_spans(
    scores: torch.Tensor, zoom: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, the ``count`` best-scoring spans by router ``scores`` (H, N) that ``zoom``
    (H, N) left out: span ids (H, M) and whether each is one (H, M) (a span scored -inf, left
    out by the prefilter, never is). M = min(count, N)."""
    count = min(count, zoom.shape[1])
    left = scores.float().masked_fill(zoom, float("-inf"))
    top = left.topk(count, dim=1)
    return top.indices, top.values > float("-inf")


def near_entry(
    memory: SpanMemory,
    layer: int,
    q: torch.Tensor,
    scaling: float,
    index: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The near spans' softmax entry for queries ``q`` (H, G, Tq, D): logit (H, G, Tq) (scaled;
    -inf for a head without near spans) and value (H, G, Tq, D) in ``q``'s dtype; None when no
    head has one. ``index``, ``valid`` (H, M): from :func:`near_spans`.

    Only the sketch rows of spans some head holds near are scored; each head keeps its own.
    """
    if index.numel() == 0 or not bool(valid.any()):
        return None
    H, M = index.shape
    slot = torch.full((H, memory.n_spans), -1, dtype=torch.long, device=index.device)
    heads = torch.arange(H, device=index.device)[:, None].expand(H, M)
    slot[heads[valid], index[valid]] = torch.arange(M, device=index.device).expand(H, M)[valid]
    held = (slot >= 0).any(dim=0)  # (N,) near for some head
    rows = held[memory.sketch_span].nonzero().squeeze(1)  # (R,) their sketch rows
    local = slot[:, memory.sketch_span[rows]]  # (H, R) slot of each row's span, -1: not near
    est = sketch_logits(memory, layer, q, rows).float() * scaling  # (H, G, Tq, R)
    est = est.masked_fill((local < 0)[:, None, None], float("-inf"))
    logit = est.logsumexp(dim=-1)  # (H, G, Tq)
    weights = (est - logit[..., None].clamp(min=-1e30)).exp()  # each row's share
    per_span = weights.new_zeros(*weights.shape[:3], M)
    per_span.scatter_add_(3, local.clamp(min=0)[:, None, None].expand_as(weights), weights)
    values = memory.span_values(layer, index).float()  # (H, M, D)
    value = torch.einsum("hgtm,hmd->hgtd", per_span, values)
    return logit, value.to(q.dtype)
