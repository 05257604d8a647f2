"""Routing: which spans to zoom into, per layer and KV head, for the current queries.

A router estimates, for every span, the largest attention logit any current query of a KV head's
group would give one of the span's tokens (scaled, natural-log units). :func:`select` then zooms
the best spans under a token budget, but only those within ``margin`` of the best span: a span
whose best token would weigh e^-margin of the best one is not worth its reconstruction.

Routers (training-free; a trained router plugs in through the same ``scores`` method):

- ``sketch`` (default): each span key reduced to a few numbers (32 dims, 4-bit, resident; see
  :mod:`sekv_core.sketch`); a span scores its max estimated logit.
- ``summary``: query . span summary + log|S| (the paper's coarse score; routes poorly untrained).
- ``oracle``: the exact max logit over the span's reconstructed keys (a diagnostic: it reads every
  span's basis, so it saves nothing).

The trained router (:class:`TrainedRouter`, ``sekv train``) scores spans with a learned gate whose
logit is > 0 for spans to zoom (its ``absolute`` threshold replaces the margin rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from .sketch import sketch_logits

if TYPE_CHECKING:
    from .zoom import SpanMemory


class Router(Protocol):
    name: str

    def scores(
        self, memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """q: (H_kv, G, Tq, D) queries of one layer -> (H_kv, N) estimated max logit per span."""
        ...


def segment_max(values: torch.Tensor, segment_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Max of ``values`` (H, S) over segments given by ``segment_ids`` (S,) -> (H, n)."""
    out = values.new_full((values.shape[0], n), float("-inf"))
    index = segment_ids[None].expand_as(values)
    return out.scatter_reduce(1, index, values, reduce="amax", include_self=True)


class SketchRouter:
    name = "sketch"

    def scores(
        self, memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        logits = sketch_logits(memory, layer, q)  # (H, G, Tq, S)
        best = logits.amax(dim=(1, 2)) * scaling  # (H, S)
        return segment_max(best, memory.sketch_span, memory.n_spans)


class SummaryRouter:
    name = "summary"

    def scores(
        self, memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        summary = memory.summary_k[layer].to(q.dtype)
        logits = torch.einsum("hgtd,hnd->hgtn", q, summary)  # (H, G, Tq, N)
        return logits.amax(dim=(1, 2)) * scaling + memory.log_len[None]


class OracleRouter:
    name = "oracle"

    def scores(
        self, memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        keys = memory.all_span_keys(layer)  # (H, S, D) every span token, reconstructed
        logits = torch.einsum("hgtd,hsd->hgts", q, keys.to(q.dtype))
        best = logits.amax(dim=(1, 2)) * scaling  # (H, S)
        return segment_max(best, memory.sketch_span, memory.n_spans)


def exact_span_share(memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float):
    """(H, N) each span's share of the attention that queries ``q`` (H, G, Tq, D) give the span
    tokens, with their exact keys (a softmax over span tokens only), averaged over the group's
    heads and the queries: what a zoom decision should hold. A diagnostic (every key is
    reconstructed, as for :class:`OracleRouter`)."""
    keys = memory.all_span_keys(layer)  # (H, S, D)
    probs = (torch.einsum("hgtd,hsd->hgts", q, keys.to(q.dtype)).float() * scaling).softmax(-1)
    per_row = probs.mean(dim=(1, 2))  # (H, S)
    share = per_row.new_zeros(per_row.shape[0], memory.n_spans)
    return share.index_add_(1, memory.sketch_span, per_row)


class TrainedRouter:
    """The learned relevance gate (:mod:`sekv_core.zoomnet`): a span is zoomed for a KV head
    when any query head of its group, at any current query, gives it a gate logit > 0."""

    name = "trained"
    absolute = True  # scores are gate logits: zoom above 0 (under the budget), no margin

    def __init__(self, net) -> None:
        self.net = net

    def scores(
        self, memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        from .zoomnet import sketch_spans

        spans = sketch_spans(memory, layer, q, scaling)
        z = self.net.gate.logits(layer, q, spans, memory.log_len, scaling)
        return z.amax(dim=(1, 2))


class MarginRouter:
    """Another router's scores shifted so that 0 is its margin threshold: lets a margin-ruled
    router (the oracle, when measuring recall) sit beside an absolute-threshold one."""

    def __init__(self, inner: Router, margin: float) -> None:
        self.inner, self.margin, self.name = inner, margin, inner.name

    def scores(
        self, memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        s = self.inner.scores(memory, layer, q, scaling)
        return s - (s.amax(dim=1, keepdim=True) - self.margin)


ROUTERS = {r.name: r for r in (SketchRouter, SummaryRouter, OracleRouter)}
SELECT_ROUNDS = 4  # batched greedy passes of :func:`select`


def select(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    budget: int,
    margin: float | None,
    rounds: int = SELECT_ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zoom decision per KV head: best spans first while the token budget lasts; a span that no
    longer fits is skipped and the next ones are tried (greedy by score).

    scores : (H, N) estimated max logits (or gate logits when ``margin`` is None: then a span
    must score above 0); lengths : (N,) span lengths.
    Returns zoom (H, N) bool and the per-head threshold (H,) a span had to reach.

    Greedy in rank order is computed in ``rounds`` batched passes: each pass takes the longest
    prefix (in rank order) of the still-eligible spans that fits in what is left; the spans left
    out are only those the greedy order would skip or reach later. Exact when at most
    ``rounds - 1`` spans are skipped (else the last pass stops at its cut).
    """
    if margin is None:
        threshold = scores.new_zeros(scores.shape[0])
    else:
        threshold = scores.amax(dim=1) - margin  # (H,)
    order = scores.argsort(dim=1, descending=True)  # (H, N)
    ranked_len = lengths[order]  # (H, N)
    open_ = scores.gather(1, order) >= threshold[:, None]  # above the threshold, undecided
    taken = torch.zeros_like(open_)
    left = torch.full_like(ranked_len[:, :1], budget)  # (H, 1) tokens left
    for _ in range(rounds):
        open_ = open_ & (ranked_len <= left)  # what no longer fits is skipped for good
        used = (ranked_len * open_).cumsum(dim=1)
        take = open_ & (used <= left)
        taken |= take
        open_ &= ~take
        left = left - (ranked_len * take).sum(dim=1, keepdim=True)
    zoom = torch.zeros_like(taken).scatter(1, order, taken)
    return zoom, threshold
