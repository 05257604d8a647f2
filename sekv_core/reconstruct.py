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

from . import kernels

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
    gathered = _gathered(mem, layer, spans, heads)
    order = None
    if gathered is None:
        if heads.numel() > 1 and not bool((heads[1:] >= heads[:-1]).all()):
            order = heads.argsort(stable=True)  # the codebook decodes rows grouped by head
            spans, heads = spans[order], heads[order]
        ranges, along = record_ranges(mem, layer, spans, heads)
        # each KV head's rows (the pairs are grouped by head), one host copy for both kinds
        head_rows = ranges.counts.new_zeros(mem.num_kv_heads).index_add_(0, heads, ranges.counts)
        head_rows = head_rows.tolist()
        k_records, v_records = (records(mem, kind, ranges) for kind in ("k", "v"))
        pos = mem.starts[spans].repeat_interleave(ranges.counts) + along
        pos = pos.clamp(max=mem.context_len - 1)
    else:
        k_records, v_records, pos, head_rows = gathered
    keys = decoded(mem, "k", layer, k_records, head_rows)  # pre-RoPE
    if not mem.bounded:
        keys = mem.rope.rotate(keys, pos)
    values = decoded(mem, "v", layer, v_records, head_rows)
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


def _gathered(
    mem: SpanMemory, layer: int, spans: torch.Tensor, heads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | None:
    """The pairs' records, positions and rows per head read in one native call
    (:func:`sekv_core.kernels.gather`), or None where the tensor code reads them."""
    offload = getattr(mem.store, "offload", None)  # a streamed build reads its part files
    if offload is None:
        return None
    k_buf, v_buf = offload["k_rows"], offload["v_rows"]
    tables = (spans, heads, mem.record0, mem.record_stride, mem.host_lengths, mem.starts)
    if not (
        all(t.dtype == torch.long for t in tables)
        and k_buf.dtype == v_buf.dtype == torch.uint8
        and kernels.usable(*tables, k_buf, v_buf)
    ):
        return None
    k_bytes, v_bytes = mem.codebooks["k"].record_bytes, mem.codebooks["v"].record_bytes
    return kernels.gather(mem, layer, spans, heads, k_buf, v_buf, k_bytes, v_bytes)


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


def records(mem: SpanMemory, kind: str, ranges: RecordRanges) -> torch.Tensor:
    """(T, bytes) records of one kind at ``ranges`` (:func:`record_ranges`), in one read."""
    return mem.store.offload_records(f"{kind}_rows", mem.codebooks[kind].record_bytes, ranges)


def decoded(
    mem: SpanMemory, kind: str, layer: int, records: torch.Tensor, head_rows: list[int]
) -> torch.Tensor:
    """(T, D) rows of one kind of ``layer`` from their ``records``, grouped by KV head,
    ``head_rows`` of each; keys pre-RoPE, in the model dtype on the device. Decoded at once on
    the host (where the records and the codebook are)."""
    rows = mem.codebooks[kind].decode(records, layer, head_rows, mem.dtype)
    return rows.to(mem.device, non_blocking=True)
