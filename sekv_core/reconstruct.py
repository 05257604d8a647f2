"""Zoom-in reconstruction: token-level K/V of (span, head) pairs from the offload tier.

A span's rows of one (layer, KV head) are one contiguous range of fixed-size records in the
offload tier (:mod:`sekv_core.codec`; per part, (L, H, rows, record) in row order, parts one
after another). All pairs of one layer are read at once, one record index for both kinds, and
decoded on the host in one product per kind with the codebook; the rows go to the device in the
model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .rope import rotate_half

if TYPE_CHECKING:  # the memory passes itself in; this module only reads its tables
    from .zoom import SpanMemory


@dataclass
class RecordRanges:
    """``counts[i]`` records from record ``first[i]`` on, for every i (host int64), and
    ``index``, every record's number one range after another (what a mapped file reads)."""

    first: torch.Tensor
    counts: torch.Tensor
    index: torch.Tensor


def reconstruct(
    mem: SpanMemory, layer: int, spans: torch.Tensor, heads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level K, V of (span, head) pairs (``spans``, ``heads``: (n,) host tensors) of one
    layer, flat in pair order: (T, D) each in the model dtype, T the pairs' total length.

    Keys are rotated to their positions (bounded memories: kept pre-RoPE, rotated where the
    pool places them).
    """
    order = None
    if heads.numel() > 1 and not bool((heads[1:] >= heads[:-1]).all()):
        order = heads.argsort(stable=True)  # the codebook decodes rows grouped by head
        spans, heads = spans[order], heads[order]
    ranges, along = record_ranges(mem, layer, spans, heads)
    # each KV head's rows (the pairs are grouped by head), one host copy for both kinds
    head_rows = ranges.counts.new_zeros(mem.num_kv_heads).index_add_(0, heads, ranges.counts)
    head_rows = head_rows.tolist()
    keys = rows(mem, "k", layer, ranges, head_rows)  # pre-RoPE
    if not mem.bounded:
        pos = (mem.starts[spans].repeat_interleave(ranges.counts) + along).clamp(
            max=mem.context_len - 1
        )
        cos, sin = mem.rope.tables(pos, keys)
        keys = keys * cos + rotate_half(keys) * sin
    values = rows(mem, "v", layer, ranges, head_rows)
    if order is not None:  # back to the pairs' order, token by token
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        counts = ranges.counts[back]
        first = (torch.cumsum(ranges.counts, 0) - ranges.counts)[back]  # in the sorted order
        starts = torch.cumsum(counts, 0) - counts
        tokens = (first - starts).repeat_interleave(counts) + torch.arange(int(counts.sum()))
        tokens = tokens.to(keys.device)
        keys, values = keys.index_select(0, tokens), values.index_select(0, tokens)
    return keys, values


def record_ranges(
    mem: SpanMemory, layer: int, spans: torch.Tensor, heads: torch.Tensor
) -> tuple[RecordRanges, torch.Tensor]:
    """The records of (span, head) pairs of ``layer`` in a flat offload buffer of records
    (``<kind>_rows``; the same for both kinds), and each record's place in its span (T,)."""
    counts = mem.host_lengths[spans]
    first = mem.record0[spans] + (layer * mem.num_kv_heads + heads) * mem.record_stride[spans]
    starts = torch.cumsum(counts, 0) - counts  # each pair's first row among all T rows
    pair = torch.repeat_interleave(counts)  # (T,) each row's pair
    along = torch.arange(pair.numel()) - starts[pair]
    return RecordRanges(first, counts, first[pair] + along), along


def rows(
    mem: SpanMemory, kind: str, layer: int, ranges: RecordRanges, head_rows: list[int]
) -> torch.Tensor:
    """(T, D) rows of one kind of ``layer`` at ``ranges`` (:func:`record_ranges`), grouped by
    KV head, ``head_rows`` of each; keys pre-RoPE, in the model dtype on the device.
    Every pair's records in one read, decoded at once on the host (where the records and the
    codebook are)."""
    code = mem.codebooks[kind]
    records = mem.store.offload_records(f"{kind}_rows", code.record_bytes, ranges)
    decoded = code.decode(records, layer, head_rows, mem.dtype)
    return decoded.to(mem.device, non_blocking=True)
