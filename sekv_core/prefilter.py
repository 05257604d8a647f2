"""Long documents: routers score only the spans worth scoring (a prefilter), and a view of them.

Above ``min_spans`` spans (books), each KV head keeps the spans whose *representative* tokens
(each span's highest-surprisal sketch rows) score best for the current queries; the router then
scores exactly those spans only, through a :class:`SpanSubset` that looks like the memory.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .sketch import sketch_logits

if TYPE_CHECKING:  # the memory is passed in; this module only reads it
    from .zoom import SpanMemory

# above this many spans (books of ~60K tokens), routers only score the spans whose representative
# tokens score among the best ``keep`` (or 4x the budget's worth of spans) per KV head
PREFILTER_SPANS = 2048
PREFILTER_KEEP = 256


def representative_scores(memory: SpanMemory, layer: int, q: torch.Tensor) -> torch.Tensor:
    """(H, N) sketch logit (unscaled) of each span's best representative token for queries
    ``q`` (H, G, Tq, D): the exact sketch score restricted to a few rows per span."""
    H = q.shape[0]
    rows = memory.span_reps.flatten()  # (N * k,)
    best = sketch_logits(memory, layer, q, rows).amax(dim=(1, 2))  # (H, N * k)
    return best.view(H, memory.n_spans, -1).amax(dim=-1)


def candidates(
    memory: SpanMemory,
    layer: int,
    q: torch.Tensor,
    budget: int,
    keep: int = PREFILTER_KEEP,
    min_spans: int = PREFILTER_SPANS,
) -> torch.Tensor | None:
    """Spans worth scoring for queries ``q`` (H, G, Tq, D), or None to score them all.

    Long documents only (more than ``min_spans`` spans): the union over KV heads of each
    head's best max(keep, 4 x budget / mean span length) spans by
    :func:`representative_scores` (sorted span ids). The exact sketch router's picks
    are not all among the best representatives (a span can win on a token of low surprisal):
    this trades some routing fidelity for a cost that stays flat in the document's length.
    """
    if memory.span_reps is None or memory.n_spans <= min_spans:
        return None
    best = representative_scores(memory, layer, q)  # (H, N)
    mean_len = float(memory.lengths.float().mean())
    keep = min(memory.n_spans, max(keep, math.ceil(4 * budget / mean_len)))
    picked = torch.zeros(memory.n_spans, dtype=torch.bool, device=best.device)
    picked[best.topk(keep, dim=1).indices.flatten()] = True
    return torch.nonzero(picked)[:, 0]


class _OneLayer:
    """A per-layer tensor of a :class:`SpanSubset`: indexable by its layer only."""

    def __init__(self, layer: int, tensor: torch.Tensor) -> None:
        self.layer, self.tensor = layer, tensor

    def __getitem__(self, layer: int) -> torch.Tensor:
        if layer != self.layer:
            raise IndexError(f"subset of layer {self.layer} read at layer {layer}")
        return self.tensor


class SpanSubset:
    """Spans ``index`` (K,) of a :class:`SpanMemory` at one layer, as a router reads them.

    Span ids are local (0..K-1); the caller maps the scores back with ``index``.
    """

    def __init__(self, memory: SpanMemory, layer: int, index: torch.Tensor) -> None:
        self.memory, self.index = memory, index
        self.num_layers, self.num_kv_heads = memory.num_layers, memory.num_kv_heads
        self.head_dim, self.bounded = memory.head_dim, memory.bounded
        self.n_spans = int(index.numel())
        self.lengths, self.log_len = memory.lengths[index], memory.log_len[index]
        first = torch.cumsum(memory.lengths, 0) - memory.lengths  # (N,) first sketch row
        device = index.device
        local = torch.repeat_interleave(torch.arange(self.n_spans, device=device), self.lengths)
        within = (
            torch.arange(local.numel(), device=device)
            - (torch.cumsum(self.lengths, 0) - self.lengths)[local]
        )
        self.rows = first[index][local] + within  # (S_k,) sketch rows of the subset's tokens
        self.sketch_span = local
        self.sketch_proj, self.sketch_scale = memory.sketch_proj, memory.sketch_scale
        self.sketch_mean = memory.sketch_mean
        self.sketch = _OneLayer(layer, memory.sketch[layer][:, self.rows])
        self.layer = layer
