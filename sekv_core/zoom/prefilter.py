"""Long documents: routers score only the spans worth scoring (a prefilter).

Above ``min_spans`` spans (books), each KV head keeps the spans whose *representative* tokens
(each span's highest-surprisal sketch rows) score best for the current queries; the router then
scores exactly those spans only (:meth:`sekv_core.zoom.memory.SpanMemory.subset`).

So that the cost per query does not grow with the book, the representatives are not all scored:
:class:`RepBlocks` keeps, per block of ``BLOCK_SPANS`` consecutive spans, the box (least and
greatest level per sketch dimension) of its representative rows, which bounds any query's logit on
them from above. The blocks with the highest bounds are opened and their spans scored exactly.

Everything here reads a :class:`RepTables` (the sketch and the representatives), not the memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..sketch import dequantize_sketch, sketch_logits

# above this many spans, routers only score the spans whose representative tokens score among
# the best ``keep`` (or 4x the budget's worth of spans) per KV head
PREFILTER_SPANS = 2048
PREFILTER_KEEP = 256
BLOCK_SPANS = 16  # spans per block of the coarse index
UPDATE_BLOCKS = 1024  # blocks read at once while the index grows or is rebuilt
OPEN_FACTOR = 8  # blocks opened per KV head: this many times the blocks ``keep`` spans fill


@dataclass(frozen=True)
class RepTables:
    """What the prefilter reads (on the device): the routing sketch of every span token as
    :func:`sekv_core.sketch.sketch_logits` reads it, each span's representative rows and its
    length.

    sketch : (L, H, S, C) the rows' codes (int8, or 4-bit pairs); sketch_proj : (L, H, D, R);
    sketch_scale : (L, H, R); sketch_mean : (L, H, D); span_reps : (N, k) each span's
    representative rows of the sketch; lengths : (N,) its tokens.
    """

    sketch: torch.Tensor
    sketch_proj: torch.Tensor
    sketch_scale: torch.Tensor
    sketch_mean: torch.Tensor
    span_reps: torch.Tensor
    lengths: torch.Tensor

    @property
    def n_spans(self) -> int:
        return int(self.lengths.numel())


class RepBlocks:
    """The coarse index of a memory's representative rows: per complete block of
    ``BLOCK_SPANS`` spans, per layer and KV head, the least and greatest sketch level per
    dimension over the block's representative rows, (L, H, B, R) each. Grown block by block as a
    streamed store appends spans; rebuilt when the stored levels change (the sketch's scale
    widened, or fewer dimensions placed)."""

    def __init__(self) -> None:
        self.lo: torch.Tensor | None = None
        self.hi: torch.Tensor | None = None
        self.key: torch.Tensor | None = None  # the sketch scale the levels were read with

    @property
    def n_blocks(self) -> int:
        return 0 if self.lo is None else self.lo.shape[2]

    def update(self, tables: RepTables) -> None:
        """Index the complete blocks of ``tables`` not indexed yet (all of them when the
        sketch's scale changed)."""
        scale = tables.sketch_scale
        if self.key is None or self.key.shape != scale.shape or not torch.equal(self.key, scale):
            self.lo = self.hi = None
            self.key = scale.clone()
        done, total = self.n_blocks, tables.n_spans // BLOCK_SPANS
        if total <= done:
            return
        reps = tables.span_reps[done * BLOCK_SPANS : total * BLOCK_SPANS].view(total - done, -1)
        dim = tables.sketch_proj.shape[-1]
        L, H = tables.sketch.shape[:2]
        lo = torch.empty(L, H, total - done, dim, dtype=torch.int8, device=reps.device)
        hi = torch.empty_like(lo)
        for layer in range(L):  # a layer and UPDATE_BLOCKS at a time: a rebuild stays small
            for a in range(0, total - done, UPDATE_BLOCKS):
                rows = reps[a : a + UPDATE_BLOCKS]  # (b, rows per block)
                packed = tables.sketch[layer][:, rows.flatten()]
                levels = dequantize_sketch(packed, dim, torch.float32).view(H, *rows.shape, dim)
                lo[layer, :, a : a + len(rows)] = levels.amin(dim=2).to(torch.int8)
                hi[layer, :, a : a + len(rows)] = levels.amax(dim=2).to(torch.int8)
        self.lo = lo if self.lo is None else torch.cat([self.lo, lo], dim=2)
        self.hi = hi if self.hi is None else torch.cat([self.hi, hi], dim=2)

    def bounds(self, tables: RepTables, layer: int, q: torch.Tensor) -> torch.Tensor:
        """(H, B) upper bound of the sketch logit (unscaled) of queries ``q`` (H, G, Tq, D) on
        any representative row of each complete block."""
        proj = tables.sketch_proj[layer].to(q.dtype)  # (H, D, R)
        scale = tables.sketch_scale[layer].to(q.dtype)[:, None, None]
        qs = (torch.einsum("hgtd,hdr->hgtr", q, proj) * scale).flatten(1, 2)  # (H, Q, R)
        lo, hi = self.lo[layer].to(q.dtype), self.hi[layer].to(q.dtype)  # (H, B, R)
        top = qs.clamp(min=0) @ hi.transpose(1, 2) + qs.clamp(max=0) @ lo.transpose(1, 2)
        offset = torch.einsum("hgtd,hd->hgt", q, tables.sketch_mean[layer].to(q.dtype))
        return (top + offset.flatten(1)[..., None]).amax(dim=1)


def representative_scores(
    tables: RepTables, layer: int, q: torch.Tensor, spans: torch.Tensor | None = None
) -> torch.Tensor:
    """(H, N) sketch logit (unscaled) of each span's best representative token for queries
    ``q`` (H, G, Tq, D): the exact sketch score restricted to a few rows per span (``spans``
    (K,): of those spans only, (H, K))."""
    H = q.shape[0]
    reps = tables.span_reps if spans is None else tables.span_reps[spans]
    best = sketch_logits(tables, layer, q, reps.flatten()).amax(dim=(1, 2))  # (H, K * k)
    return best.view(H, reps.shape[0], -1).amax(dim=-1)


def opened_spans(
    tables: RepTables, blocks: RepBlocks, layer: int, q: torch.Tensor, keep: int
) -> torch.Tensor:
    """Sorted ids of the spans worth scoring exactly: those of the ``OPEN_FACTOR`` x
    keep / BLOCK_SPANS blocks with the highest bounds per KV head (``blocks``, brought up to
    date with ``tables`` first), and every span after the last complete block."""
    blocks.update(tables)
    n_open = min(blocks.n_blocks, math.ceil(OPEN_FACTOR * keep / BLOCK_SPANS))
    opened = torch.zeros(blocks.n_blocks, dtype=torch.bool, device=q.device)
    if n_open:
        opened[blocks.bounds(tables, layer, q).topk(n_open, dim=1).indices.flatten()] = True
    ids = torch.nonzero(opened)[:, 0]
    within = torch.arange(BLOCK_SPANS, device=q.device)
    spans = (ids[:, None] * BLOCK_SPANS + within).flatten()
    tail = torch.arange(blocks.n_blocks * BLOCK_SPANS, tables.n_spans, device=q.device)
    return torch.cat([spans, tail])


def candidates(
    tables: RepTables | None,
    layer: int,
    q: torch.Tensor,
    budget: int,
    keep: int = PREFILTER_KEEP,
    min_spans: int = PREFILTER_SPANS,
    blocks: RepBlocks | None = None,
) -> torch.Tensor | None:
    """Spans worth scoring for queries ``q`` (H, G, Tq, D), or None to score them all.

    Long documents only (more than ``min_spans`` spans; ``tables`` None: a memory without
    representatives): the union over KV heads of each head's best max(keep, 4 x budget / mean
    span length) spans by :func:`representative_scores` (sorted span ids); with ``blocks``,
    among the spans of the blocks :func:`opened_spans` opens only. The exact sketch router's
    picks are not all among the best representatives (a span can win on a token of low
    surprisal): this trades some routing fidelity for a cost that grows slowly with the
    document's length (``blocks``: stays flat, at a further loss — a streamed chunk's routing,
    not a question's).
    """
    if tables is None or tables.n_spans <= min_spans:
        return None
    n_spans = tables.n_spans
    mean_len = float(tables.lengths.float().mean())
    keep = min(n_spans, max(keep, math.ceil(4 * budget / mean_len)))
    spans = opened_spans(tables, blocks, layer, q, keep) if blocks is not None else None
    best = representative_scores(tables, layer, q, spans)  # (H, K)
    if spans is None:
        spans = torch.arange(n_spans, device=best.device)
    picked = torch.zeros(n_spans, dtype=torch.bool, device=best.device)
    picked[spans[best.topk(min(keep, spans.numel()), dim=1).indices.flatten()]] = True
    return torch.nonzero(picked)[:, 0]
