"""Zoom pools: one layer's zoomed tokens, held in slots that later steps reuse.

A pool holds, per KV head, a fixed number of token slots (the zoom budget) of 8-bit K/V rows
(:mod:`sekv_core.kvquant`). At each step the spans a head zooms are *active*. A span the head
held before and zooms again keeps its slots (nothing is copied); only the newly zoomed (span,
head) pairs are reconstructed, all in one batch, into the slots of spans no longer zoomed, the
least recently active first, so a span that drops out for a step and comes back is often still
there. Attention reads every slot with the inactive ones masked out (the order of a softmax's
entries does not change it). The pool is the layer's only copy of its reconstructions.

Bounded memories (books) place each head's active tokens in document order right before
``pool_end`` (an answer's pinned passages passage by passage, the best last: a ``placement`` of
the spans): their keys are kept pre-RoPE and rotated to those positions when the picks change.

A pool's methods change the pool only; the span tables they read (each span's length and first
row of the sketch order, (N,) int64 on the host) and the rows of new pairs are passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kvquant import Rows
from ..native import kernels
from ..rope import Rope, rotate_half

NEVER = torch.iinfo(torch.int64).max  # the last use of a slot that must not be taken

# K, V (T, D) of (span, head) pairs, given ``spans`` and ``heads`` (n,) on the host, flat in
# pair order (each pair's tokens in document order)
ReadPairs = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KeyFrame:
    """Where a bounded memory's pooled keys are rotated to: each head's active tokens in
    document order right before ``pool_end`` (with a ``placement`` (N,) of the spans: passage
    by passage, by placement), by ``rope`` in ``dtype``."""

    rope: Rope
    pool_end: int
    placement: torch.Tensor | None
    dtype: torch.dtype


@dataclass
class ZoomPool:
    """One layer's zoomed tokens: K and V (2, H, C, D) as Rows of ``kv_bits`` in C slots per KV
    head, the keys as reconstructed (bounded memories: pre-RoPE, ``rotated`` holds them at the
    pool's positions).

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
    kv_bits: int
    rotated: Rows | None = None
    order: torch.Tensor | None = None  # see document_order
    updates: int = 0

    @classmethod
    def empty(
        cls, zoom: torch.Tensor, capacity: int, head_dim: int, kv_bits: int, device: torch.device
    ) -> ZoomPool:
        """A pool of ``capacity`` free slots per KV head (at least one) for picks shaped like
        ``zoom`` (H, N)."""
        H, N = zoom.shape
        C = max(1, capacity)
        rows = Rows.empty((2, H, C), head_dim, kv_bits, device)
        free = torch.full((H, C), -1, dtype=torch.long, device=zoom.device)
        token = free.clone()
        held = torch.zeros(H, N, dtype=torch.bool, device=zoom.device)
        bias = torch.zeros(H, C, device=zoom.device)
        return cls(rows, free, free.clone(), held, zoom, held, bias, None, token, kv_bits)

    @property
    def tokens(self) -> int:
        """Head-tokens held (free slots included)."""
        return self.owner.numel()

    def holds(self, zoom: torch.Tensor, pool_end: int | None) -> bool:
        """Whether the last update was to these picks (nothing to do)."""
        return pool_end == self.pool_end and same(self.zoom, zoom)

    def kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V (H, C, D) as attention reads them, in ``dtype``."""
        if self.rotated is None:
            keys, values = self.rows.read(dtype)
            return keys, values
        return self.rotated.read(dtype), self.rows.layer(1).read(dtype)

    def update(
        self,
        zoom: torch.Tensor,
        pool_end: int | None,
        read: ReadPairs,
        lengths: torch.Tensor,
        first_row: torch.Tensor,
        frame: KeyFrame | None = None,
    ) -> int:
        """Hold the picks ``zoom`` (H, N) bool: the (span, head) pairs not held are read with
        ``read`` in one batch and placed (:meth:`place_new_spans`), the picked spans' slots
        made active, and, with a ``frame`` (bounded memories), their keys rotated to it.
        ``lengths``, ``first_row``: (N,) the spans' tables. Returns the head-tokens read."""
        if self.held.shape[1] < zoom.shape[1]:  # the memory grew (a streamed build)
            self.held = torch.nn.functional.pad(self.held, (0, zoom.shape[1] - self.held.shape[1]))
        self.updates += 1
        new = self.place_new_spans(zoom, read, lengths, first_row)
        if self.in_native_code(zoom, lengths, first_row):
            active, self.bias = kernels.activate(zoom, self.owner, self.last, self.updates)
        else:
            active = of_span(zoom, self.owner)
            self.last.masked_fill_(active, self.updates)
            self.bias = torch.where(active, 0.0, torch.finfo(torch.float32).min)
        self.active, self.zoom, self.pool_end = active, zoom, pool_end  # zoom: not mutated
        self.order = None  # of the previous picks
        if frame is not None:
            self.rotated = self.rotated_keys(frame)
        return new

    def place_new_spans(
        self, zoom: torch.Tensor, read: ReadPairs, lengths: torch.Tensor, first_row: torch.Tensor
    ) -> int:
        """Read the picked (span, head) pairs the pool does not hold, in one batch, into slots
        that no picked span uses (free first, then the least recently active). Returns the
        head-tokens read. On the CPU the bookkeeping is native code
        (:mod:`sekv_core.native.kernels`), with the same placement."""
        fast = self.in_native_code(zoom, lengths, first_row)
        if fast:
            heads, spans, needed = kernels.new_pairs(zoom, self.held, self.owner, lengths)
        else:
            pairs = (zoom & ~self.held).nonzero()  # (n, 2): (head, span), head-major
            heads, spans = pairs[:, 0].cpu(), pairs[:, 1].cpu()
        if not spans.numel():
            return 0
        k, v = read(spans, heads)
        if fast:
            if needed > self.owner.shape[1]:
                self.widen(needed)
            k, v = (t.float().contiguous() for t in (k, v))
            kernels.place(self, zoom, heads, spans, lengths, first_row, k, v)
            return k.shape[0]
        device, H = zoom.device, zoom.shape[0]
        span_lengths = lengths[spans]
        row_head = heads.repeat_interleave(span_lengths).to(device)  # (T,)
        per_head = torch.bincount(row_head, minlength=H)  # (H,)
        owner = self.owner
        keep = of_span(zoom, owner)  # slots of picked held spans
        needed = int((keep.sum(dim=1) + per_head).max())
        if needed > owner.shape[1]:
            self.widen(needed)
            owner = self.owner
            keep = torch.nn.functional.pad(keep, (0, needed - keep.shape[1]))
        # free (-1) first, then the oldest; ties in slot order
        order = torch.where(keep, NEVER, self.last).argsort(dim=1, stable=True)
        first_of_head = torch.cumsum(per_head, 0) - per_head
        rank = torch.arange(row_head.numel(), device=device) - first_of_head[row_head]
        slot = order[row_head, rank]
        evicted = owner[row_head, slot]
        gone = evicted >= 0
        self.held[row_head[gone], evicted[gone]] = False
        # each new row's span and span token (its row of the sketch order), on the host
        shift = first_row[spans] - (torch.cumsum(span_lengths, 0) - span_lengths)
        owner[row_head, slot] = spans.repeat_interleave(span_lengths).to(device)
        token = torch.arange(row_head.numel()) + shift.repeat_interleave(span_lengths)
        self.token[row_head, slot] = token.to(device)
        self.rows.put((slice(None), row_head, slot), Rows.encode(torch.stack([k, v]), self.kv_bits))
        self.held[heads.to(device), spans.to(device)] = True
        # what is left of evicted spans is of no use: their slots are free
        stale = (owner >= 0) & ~of_span(self.held, owner)
        owner.masked_fill_(stale, -1)
        self.last.masked_fill_(stale, -1)
        return int(row_head.numel())

    def in_native_code(
        self, zoom: torch.Tensor, lengths: torch.Tensor, first_row: torch.Tensor
    ) -> bool:
        """Whether an update runs in :mod:`sekv_core.native.kernels` (8-bit rows on the CPU)."""
        return (  # the pool's own tensors are contiguous, made here
            self.kv_bits == 8
            and zoom.dtype == torch.bool
            and lengths.dtype == first_row.dtype == torch.long
            and kernels.usable(zoom, self.owner)
        )

    def widen(self, capacity: int) -> None:
        """Give every KV head ``capacity`` slots (new ones free)."""
        extra = capacity - self.owner.shape[1]
        self.rows.pad(extra)
        self.owner = torch.nn.functional.pad(self.owner, (0, extra), value=-1)
        self.last = torch.nn.functional.pad(self.last, (0, extra), value=-1)
        self.token = torch.nn.functional.pad(self.token, (0, extra), value=-1)

    def document_order(self, placement: torch.Tensor | None = None) -> torch.Tensor:
        """(H, C) each head's slots, its active ones first in document order, or, with a
        ``placement`` (N,) of the spans, by placement and then in document order (computed once
        per update: a bounded pool's positions and an ordered read both follow it)."""
        if self.order is None:
            key = self.token
            if placement is not None:  # span tokens number below 2^40; placements are few
                key = placement.to(key.device)[self.owner.clamp(min=0)] * (1 << 40) + key
            self.order = torch.where(self.active, key, NEVER).argsort(dim=1)
        return self.order

    def in_document_order(
        self, dtype: torch.dtype, placement: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V (H, P, D), bias, owner and token (H, P) of the active slots only, each head's
        in document order (:meth:`document_order`; P: the most any head holds, padding absent):
        entries that do not depend on what the pool held before (a streamed build resumed from
        a checkpoint attends exactly as one never interrupted)."""
        P = int(self.active.sum(dim=1).max()) if self.active.numel() else 0
        order = self.document_order(placement)[:, :P]  # (H, P)
        keys, values = self.kv(dtype)
        index = order[..., None].expand(-1, -1, keys.shape[-1])
        return (
            keys.gather(1, index),
            values.gather(1, index),
            self.bias.gather(1, order),
            self.owner.gather(1, order),
            self.token.gather(1, order),
        )

    def rotated_keys(self, frame: KeyFrame) -> Rows:
        """Each head's active keys rotated to their positions in ``frame``: in document order
        right before its ``pool_end`` (head h's n_h tokens at pool_end - n_h, ...)."""
        H, C = self.owner.shape
        order = self.document_order(frame.placement)
        slots = torch.arange(C, device=order.device).expand(H, C)
        rank = torch.empty_like(order).scatter_(1, order, slots)
        size = self.active.sum(dim=1, keepdim=True)
        pos = (frame.pool_end - size + rank).clamp(min=0).cpu()  # (H, C); inactive: unused
        k = self.rows.layer(0).read(frame.dtype)
        like = torch.zeros(1, device=k.device, dtype=frame.dtype)
        cos, sin = (t.view(H, C, -1) for t in frame.rope.tables(pos.flatten(), like))
        return Rows.encode(k * cos + rotate_half(k) * sin, self.kv_bits)


def of_span(table: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """(H, C) bool: each slot's span is set in ``table`` (H, N) (free slots: False)."""
    if not table.shape[1]:
        return torch.zeros_like(owner, dtype=torch.bool)
    return (owner >= 0) & table.gather(1, owner.clamp(min=0))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)
