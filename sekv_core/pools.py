"""Zoom pools: one layer's zoomed tokens, held in slots that later steps reuse.

A pool holds, per KV head, a fixed number of token slots (the zoom budget) of 8-bit K/V rows
(:mod:`sekv_core.kvquant`). At each step the spans a head zooms are *active*. A span the head
held before and zooms again keeps its slots (nothing is copied); only the newly zoomed (span,
head) pairs are reconstructed, all in one batch, into the slots of spans no longer zoomed, the
least recently active first, so a span that drops out for a step and comes back is often still
there. Attention reads every slot with the inactive ones masked out (the order of a softmax's
entries does not change it). The pool is the layer's only copy of its reconstructions.

Bounded memories (books) place each head's active tokens in document order right before
``pool_end`` (an answer's pinned passages passage by passage, the best last: the memory's
``placement``): their keys are kept pre-RoPE and rotated to those positions when the picks change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import kernels
from .kvquant import Rows
from .rope import rotate_half

if TYPE_CHECKING:  # the memory passes itself in
    from .zoom import SpanMemory

NEVER = torch.iinfo(torch.int64).max  # the last use of a slot that must not be taken


@dataclass
class ZoomPool:
    """One layer's zoomed tokens: K and V (2, H, C, D) as Rows in C slots per KV head, the
    keys as reconstructed (bounded memories: pre-RoPE, ``rotated`` holds them at the pool's
    positions).

    owner (H, C): each slot's span, -1 when free; last (H, C): the update at which a slot was
    last active, -1 when free; held (H, N): the spans whose tokens are all in the pool; zoom
    (H, N), pool_end: the picks of the last update; active (H, C) and bias (H, C), 0 on active
    slots and the float32 minimum elsewhere (an additive attention bias); token (H, C): each
    slot's span token (its row of the sketch order), -1 free.
    """

    rows: Rows
    owner: torch.Tensor
    last: torch.Tensor
    held: torch.Tensor
    zoom: torch.Tensor
    active: torch.Tensor
    bias: torch.Tensor
    pool_end: int | None
    token: torch.Tensor
    rotated: Rows | None = None
    order: torch.Tensor | None = None  # see document_order
    updates: int = 0

    @property
    def tokens(self) -> int:
        """Head-tokens held (free slots included)."""
        return self.owner.numel()

    def kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (H, C, D) as attention reads them, in ``dtype``."""
        if self.rotated is None:
            keys, values = self.rows.read(dtype)
            return keys, values
        return self.rotated.read(dtype), self.rows.layer(1).read(dtype)


def in_document_order(
    pool: ZoomPool, dtype: torch.dtype, placement: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V (H, P, D), bias, owner and token (H, P) of the active slots only, each head's in
    document order (:func:`document_order`; P: the most any head holds, padding absent):
    entries that do not depend on what the pool held before (a streamed build resumed from a
    checkpoint attends exactly as one never interrupted)."""
    P = int(pool.active.sum(dim=1).max()) if pool.active.numel() else 0
    order = document_order(pool, placement)[:, :P]  # (H, P)
    keys, values = pool.kv(dtype)
    index = order[..., None].expand(-1, -1, keys.shape[-1])
    return (
        keys.gather(1, index),
        values.gather(1, index),
        pool.bias.gather(1, order),
        pool.owner.gather(1, order),
        pool.token.gather(1, order),
    )


def zoom_pool(memory: SpanMemory, layer: int, zoom: torch.Tensor, capacity: int) -> ZoomPool:
    """The layer's pool updated to the picks ``zoom`` (H, N) bool.

    ``capacity``: slots per KV head of a new pool (the zoom budget: the picks never hold more
    tokens; a pool grows if they do). A layer whose picks did not change since its last call
    gets the same pool back. Counts the answer's peak zoom memory (see
    :meth:`SpanMemory.zoom_bytes`): all pools, the new reconstructions, bounded memories'
    unrotated keys, and one call's entries in the model dtype.
    """
    pool = memory.pools.get(layer)
    if pool is not None and pool.pool_end == memory.pool_end and same(pool.zoom, zoom):
        return pool
    if memory.bounded and memory.pool_end is None:
        raise RuntimeError("a bounded span memory needs pool_end (the first local position)")
    if pool is None:
        pool = memory.pools[layer] = empty_pool(memory, zoom, capacity)
        memory.pooled_tokens += pool.tokens
    elif pool.held.shape[1] < zoom.shape[1]:  # the memory grew (a streamed build)
        grow = zoom.shape[1] - pool.held.shape[1]
        pool.held = torch.nn.functional.pad(pool.held, (0, grow))
    pool.updates += 1
    new = place_new_spans(memory, layer, pool, zoom)
    owner = pool.owner
    if in_native_code(memory, pool, zoom):
        active, pool.bias = kernels.activate(zoom, owner, pool.last, pool.updates)
    else:
        active = of_span(zoom, owner)
        pool.last.masked_fill_(active, pool.updates)
        pool.bias = torch.where(active, 0.0, torch.finfo(torch.float32).min)
    pool.active, pool.zoom, pool.pool_end = active, zoom, memory.pool_end  # zoom: not mutated
    pool.order = None  # of the previous picks
    if memory.bounded:
        pool.rotated = rotated_keys(memory, pool)
    raw_keys = memory.pooled_tokens // 2 if memory.bounded else 0  # unrotated keys stay too
    live = (memory.pooled_tokens + new + raw_keys) * memory.token_bytes
    memory.peak_cached_bytes = max(
        memory.peak_cached_bytes, live + memory.entry_bytes(owner.shape[1])
    )
    return pool


def document_order(pool: ZoomPool, placement: torch.Tensor | None = None) -> torch.Tensor:
    """(H, C) each head's slots, its active ones first in document order, or, with a
    ``placement`` (N,) of the spans, by placement and then in document order (computed once
    per update: a bounded pool's positions and an ordered read both follow it)."""
    if pool.order is None:
        key = pool.token
        if placement is not None:  # span tokens number below 2^40; placements are few
            key = placement.to(key.device)[pool.owner.clamp(min=0)] * (1 << 40) + key
        pool.order = torch.where(pool.active, key, NEVER).argsort(dim=1)
    return pool.order


def of_span(table: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """(H, C) bool: each slot's span is set in ``table`` (H, N) (free slots: False)."""
    if not table.shape[1]:
        return torch.zeros_like(owner, dtype=torch.bool)
    return (owner >= 0) & table.gather(1, owner.clamp(min=0))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def empty_pool(memory: SpanMemory, zoom: torch.Tensor, capacity: int) -> ZoomPool:
    """A pool of ``capacity`` free slots per KV head (at most the span tokens)."""
    H, N = zoom.shape
    C = max(1, min(capacity, memory.span_tokens))
    rows = Rows.empty((2, H, C), memory.head_dim, memory.kv_bits, memory.device)
    free = torch.full((H, C), -1, dtype=torch.long, device=zoom.device)
    token = free.clone()
    held = torch.zeros(H, N, dtype=torch.bool, device=zoom.device)
    bias = torch.zeros(H, C, device=zoom.device)
    return ZoomPool(rows, free, free.clone(), held, zoom, held, bias, None, token)


def place_new_spans(memory: SpanMemory, layer: int, pool: ZoomPool, zoom: torch.Tensor) -> int:
    """Reconstruct the picked (span, head) pairs the pool does not hold, in one batch, into
    slots that no picked span uses (free first, then the least recently active). Returns the
    head-tokens reconstructed. On the CPU the bookkeeping is native code (:mod:`sekv_core.kernels`),
    with the same placement."""
    fast = in_native_code(memory, pool, zoom)
    if fast:
        heads, spans, needed = kernels.new_pairs(zoom, pool.held, pool.owner, memory.host_lengths)
    else:
        pairs = (zoom & ~pool.held).nonzero()  # (n, 2): (head, span), head-major
        heads, spans = pairs[:, 0].cpu(), pairs[:, 1].cpu()
    if not spans.numel():
        return 0
    k, v = memory.reconstruct(layer, spans, heads)
    memory.reconstructions += int(spans.numel())
    if fast:
        if needed > pool.owner.shape[1]:
            widen_pool(memory, pool, needed)
        lengths, first_row = memory.host_lengths, memory.first_row
        k, v = (t.float().contiguous() for t in (k, v))
        kernels.place(pool, zoom, heads, spans, lengths, first_row, k, v)
        return k.shape[0]
    device, H = zoom.device, zoom.shape[0]
    lengths = memory.host_lengths[spans]
    row_head = heads.repeat_interleave(lengths).to(device)  # (T,)
    per_head = torch.bincount(row_head, minlength=H)  # (H,)
    owner = pool.owner
    keep = of_span(zoom, owner)  # slots of picked held spans
    needed = int((keep.sum(dim=1) + per_head).max())
    if needed > owner.shape[1]:
        widen_pool(memory, pool, needed)
        owner = pool.owner
        keep = torch.nn.functional.pad(keep, (0, needed - keep.shape[1]))
    # free (-1) first, then the oldest; ties in slot order
    order = torch.where(keep, NEVER, pool.last).argsort(dim=1, stable=True)
    first_of_head = torch.cumsum(per_head, 0) - per_head
    rank = torch.arange(row_head.numel(), device=device) - first_of_head[row_head]
    slot = order[row_head, rank]
    evicted = owner[row_head, slot]
    gone = evicted >= 0
    pool.held[row_head[gone], evicted[gone]] = False
    # each new row's span and span token (its row of the sketch order), on the host
    shift = memory.first_row[spans] - (torch.cumsum(lengths, 0) - lengths)
    owner[row_head, slot] = spans.repeat_interleave(lengths).to(device)
    token = torch.arange(row_head.numel()) + shift.repeat_interleave(lengths)
    pool.token[row_head, slot] = token.to(device)
    pool.rows.put((slice(None), row_head, slot), Rows.encode(torch.stack([k, v]), memory.kv_bits))
    pool.held[heads.to(device), spans.to(device)] = True
    # what is left of evicted spans is of no use: their slots are free
    stale = (owner >= 0) & ~of_span(pool.held, owner)
    owner.masked_fill_(stale, -1)
    pool.last.masked_fill_(stale, -1)
    return int(row_head.numel())


def in_native_code(memory: SpanMemory, pool: ZoomPool, zoom: torch.Tensor) -> bool:
    """Whether the pool's update runs in :mod:`sekv_core.kernels` (8-bit rows on the CPU)."""
    return (  # the pool's own tensors are contiguous, made here
        memory.kv_bits == 8
        and zoom.dtype == torch.bool
        and memory.host_lengths.dtype == memory.first_row.dtype == torch.long
        and kernels.usable(zoom, pool.owner)
    )


def widen_pool(memory: SpanMemory, pool: ZoomPool, capacity: int) -> None:
    """Give every KV head ``capacity`` slots (new ones free)."""
    H, C = pool.owner.shape
    extra = capacity - C
    pool.rows.pad(extra)
    pool.owner = torch.nn.functional.pad(pool.owner, (0, extra), value=-1)
    pool.last = torch.nn.functional.pad(pool.last, (0, extra), value=-1)
    pool.token = torch.nn.functional.pad(pool.token, (0, extra), value=-1)
    memory.pooled_tokens += H * extra


def rotated_keys(memory: SpanMemory, pool: ZoomPool) -> Rows:
    """Bounded memories: each head's active keys rotated to their positions, in document order
    right before ``pool_end`` (head h's n_h tokens at pool_end - n_h, ...)."""
    assert memory.pool_end is not None
    H, C = pool.owner.shape
    order = document_order(pool, memory.placement)
    slots = torch.arange(C, device=order.device).expand(H, C)
    rank = torch.empty_like(order).scatter_(1, order, slots)
    size = pool.active.sum(dim=1, keepdim=True)
    pos = (memory.pool_end - size + rank).clamp(min=0).cpu()  # (H, C); inactive: unused
    like = torch.zeros(1, device=memory.device, dtype=memory.dtype)
    cos, sin = (t.view(H, C, -1) for t in memory.rope.tables(pos.flatten(), like))
    k = pool.rows.layer(0).read(memory.dtype)
    return Rows.encode(k * cos + rotate_half(k) * sin, memory.kv_bits)
