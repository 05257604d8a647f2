"""Zoom pools: one layer's zoomed tokens, reconstructed once and reused while picks hold.

A pool holds, per KV head, the token-level K/V of the spans that head zoomed, in document order,
padded to a common length, as 8-bit rows (:mod:`sekv_core.kvquant`). A layer whose picks did not
change since its last call gets the same pool back; otherwise the tokens of spans its last pool
held are copied from it (on the device) and only the newly zoomed (span, head) pairs are
reconstructed, all in one batch. The pool is the layer's only copy of its reconstructions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .kvquant import Rows
from .rope import rotate_half

if TYPE_CHECKING:  # the memory passes itself in
    from .zoom import SpanMemory

ABSENT = torch.iinfo(torch.int32).max  # a pool slot's token id on padding (ids are int32)


@dataclass
class ZoomPool:
    """One layer's zoomed tokens: K, V (H, P, D) as Rows; owner (H, P), -1 on padding.

    ids (H, P): each slot's span token (row of the sketch order), ascending, ``ABSENT`` on
    padding; zoom (H, N), pool_end: the picks it was built for; stored_keys: the keys as
    reconstructed (bounded memories: pre-RoPE, ``keys`` are rotated to the pool's positions).
    """

    keys: Rows
    values: Rows
    owner: torch.Tensor
    ids: torch.Tensor
    zoom: torch.Tensor
    pool_end: int | None
    stored_keys: Rows

    @property
    def tokens(self) -> int:
        """Head-tokens held (padding included)."""
        return self.owner.numel()

    def kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.read(dtype), self.values.read(dtype)


def build_pool(memory: SpanMemory, layer: int, zoom: torch.Tensor) -> ZoomPool:
    """Reconstructed tokens of the spans each KV head zoomed, padded to a common length.

    zoom : (H, N) bool. Returns the pool: K, V (H, P, D) as Rows, each head's tokens in
    document order, and owner (H, P), the span of each pooled token, -1 on padding. A layer
    whose picks did not change since its last call gets the same pool back; otherwise the
    tokens of spans its last pool held are copied from it (on the device) and only the newly
    zoomed (span, head) pairs are reconstructed, all in one batch. A zoomed token costs its K/V
    once (``token_bytes``; plus, while one layer's pool is rebuilt, that layer's old pool and
    new reconstructions, and the memory entries attention reads in the model dtype: see
    :meth:`SpanMemory.zoom_bytes`). Bounded memories place each head's pool in document order
    right before ``pool_end``.
    """
    H, D = memory.num_kv_heads, memory.head_dim
    last = memory.pools.get(layer)
    if last is not None and last.pool_end == memory.pool_end and torch.equal(last.zoom, zoom):
        return last
    if memory.bounded and memory.pool_end is None:
        raise RuntimeError("a bounded span memory needs pool_end (the first local position)")
    # each head's zoomed span tokens (rows of the sketch order), ascending; padding: ABSENT
    chosen = zoom[:, memory.sketch_span]  # (H, S)
    sizes = chosen.sum(dim=1)  # (H,)
    P = int(sizes.max()) if sizes.numel() else 0
    rows = torch.arange(chosen.shape[1], device=zoom.device, dtype=torch.int32).expand(H, -1)
    ids = rows.where(chosen, ABSENT).sort(dim=1).values[:, :P].contiguous()  # (H, P)
    present = ids != ABSENT
    keys = Rows.empty(H, P, D, memory.kv_bits, memory.device)
    values = Rows.empty(H, P, D, memory.kv_bits, memory.device)
    reused = torch.zeros_like(present)
    if last is not None and last.ids.shape[1] and P:  # copy what the last pool holds
        at = torch.searchsorted(last.ids, ids).clamp(max=last.ids.shape[1] - 1)
        reused = present & (last.ids.gather(1, at) == ids)
        keys.fill(reused, last.stored_keys.gather(at).select(reused))
        values.fill(reused, last.values.gather(at).select(reused))
    new = present & ~reused  # whole spans: a pool holds every token of its spans
    span_of = memory.sketch_span[ids.clamp(max=memory.sketch_span.numel() - 1).long()]  # (H, P)
    pair = (torch.arange(H, device=zoom.device)[:, None] * memory.n_spans + span_of)[new]
    pairs = torch.unique_consecutive(pair).cpu()  # (head, span) in pool order
    if pairs.numel():
        k, v = memory.reconstruct(layer, pairs % memory.n_spans, pairs // memory.n_spans)
        memory.reconstructions += int(pairs.numel())
        keys.fill(new, Rows.encode(k, memory.kv_bits))
        values.fill(new, Rows.encode(v, memory.kv_bits))
    owner = span_of.where(present, -1).to(torch.int32)  # with ids: 8 bytes per slot
    # live now: every layer's pool, this layer's old pool (until it goes), the new
    # reconstructions, and this call's memory entries in the model dtype for the softmax
    old_pool = last.tokens if last is not None else 0
    pooled = H * P + sum(pool.tokens for i, pool in memory.pools.items() if i != layer)
    raw_keys = H * P // 2 if memory.bounded else 0  # bounded: the unrotated keys stay too
    live = (pooled + old_pool + int(new.sum()) + raw_keys) * memory.token_bytes
    memory.peak_cached_bytes = max(memory.peak_cached_bytes, live + memory.entry_bytes(P))
    stored_keys = keys
    if memory.bounded and P:  # right-aligned: head h's tokens at pool_end - size_h ...
        pos = torch.arange(P)[None] + (memory.pool_end - sizes.cpu())[:, None]  # (H, P)
        like = torch.zeros(1, device=memory.device, dtype=memory.dtype)
        cos, sin = (t.view(H, P, D) for t in memory.rope.tables(pos.clamp(min=0).flatten(), like))
        k = keys.read(memory.dtype)
        keys = Rows.encode(k * cos + rotate_half(k) * sin, memory.kv_bits)
    pool = ZoomPool(keys, values, owner, ids, zoom.clone(), memory.pool_end, stored_keys)
    memory.pools[layer] = pool
    return pool
