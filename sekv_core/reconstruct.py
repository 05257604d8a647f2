"""Zoom-in reconstruction: token-level K/V of (span, head) pairs from the offload tier.

A span's rows of one (layer, KV head) are one contiguous range of fixed-size records in the
offload tier (:mod:`sekv_core.codec`; per part, (L, H, rows, record) in row order, parts one
after another). All pairs of one layer are read at once per tensor kind and decoded on the host
in one batched product with the codebook; the rows go to the device in the model dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .rope import rotate_half

if TYPE_CHECKING:  # the memory passes itself in; this module only reads its tables
    from .zoom import SpanMemory


def reconstruct(
    mem: SpanMemory, layer: int, spans: torch.Tensor, heads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level K, V of (span, head) pairs (``spans``, ``heads``: (n,) host tensors) of one
    layer, flat in pair order: (T, D) each in the model dtype, T the pairs' total length.

    Keys are rotated to their positions (bounded memories: kept pre-RoPE, rotated where the
    pool places them).
    """
    first, lengths = record_ranges(mem, layer, spans, heads)  # the same for K and V
    pair = torch.repeat_interleave(torch.arange(spans.numel()), lengths)  # (T,) host
    row_heads = heads[pair]
    keys = rows(mem, "k", layer, first, lengths, row_heads)  # pre-RoPE
    if not mem.bounded:
        within = torch.arange(pair.numel()) - (torch.cumsum(lengths, 0) - lengths)[pair]
        pos = (mem.starts[spans][pair] + within).clamp(max=mem.context_len - 1)
        cos, sin = mem.rope.tables(pos, keys)
        keys = keys * cos + rotate_half(keys) * sin
    values = rows(mem, "v", layer, first, lengths, row_heads)
    return keys, values


def record_ranges(
    mem: SpanMemory, layer: int, spans: torch.Tensor, heads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first record and the record count of each (span, head) pair of ``layer`` in a flat
    offload buffer of records (``<kind>_rows``; the same for both kinds)."""
    first = mem.first_row[spans]  # (n,) each span's first row
    part = torch.searchsorted(mem.part_rows, first, right=True) - 1
    row0 = mem.part_rows[part]
    n_rows = mem.part_rows[part + 1] - row0
    L, H = mem.num_layers, mem.num_kv_heads
    start = L * H * row0 + (layer * H + heads) * n_rows + (first - row0)
    return start, mem.ends[spans] - mem.starts[spans]


def rows(
    mem: SpanMemory,
    kind: str,
    layer: int,
    first: torch.Tensor,
    counts: torch.Tensor,
    row_heads: torch.Tensor,
) -> torch.Tensor:
    """(T, D) rows of one kind of ``layer``: ``counts[i]`` records from record ``first[i]`` on
    (:func:`record_ranges`), ``row_heads`` (T,) each row's KV head; keys pre-RoPE, in the
    model dtype on the device. Every pair's records in one read, decoded at once on the host
    (where the records and the codebook are)."""
    code = mem.codebooks[kind]
    records = mem.store.offload_records(f"{kind}_rows", code.record_bytes, first, counts)
    decoded = code.decode(records, layer, row_heads, mem.dtype)
    return decoded.to(mem.device, non_blocking=True)
