"""Zoom-in reconstruction: token-level K/V of (span, head) pairs from the offload tier.

A span's rows of one (layer, KV head) are one contiguous range of fixed-size records in the
offload tier (per part, (L, H, rows, record) in row order, parts one after another):
:class:`RecordIndex` says where. All pairs of one layer are read at once through an
:class:`OffloadReader`, one record index for both kinds, and decoded on the host in one product
per kind with the codebook; the rows go to the device in the model dtype. A tier held whole in
memory (:class:`HeldRecords`) is read by one native gather on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..native import kernels
from ..rope import Rope


@dataclass
class RecordRanges:
    """``counts[i]`` records from record ``first[i]`` on, for every i (host int64), and
    ``index``, every record's number one range after another (what a mapped file reads)."""

    first: torch.Tensor
    counts: torch.Tensor
    index: torch.Tensor


class OffloadReader(Protocol):
    """What reconstruction reads of an offload tier: a loaded store's
    (:class:`HeldRecords`) or a streamed build's part files."""

    def offload_records(self, name: str, size: int, ranges: RecordRanges) -> torch.Tensor:
        """Records (sum(counts), size) uint8 of the flat byte buffer ``name`` (``k_rows``,
        ``v_rows``) read as records of ``size`` bytes at ``ranges``."""
        ...


class RecordCode(Protocol):
    """A kind's offload code: its record size and its decoder (:mod:`sekv_core.store.codes`)."""

    record_bytes: int

    def decode(
        self, records: torch.Tensor, layer: int, heads: torch.Tensor | list[int], dtype: torch.dtype
    ) -> torch.Tensor: ...


@runtime_checkable
class HeldRecords(OffloadReader, Protocol):
    """An offload tier held in memory (a loaded store's
    :class:`~sekv_core.store.entropy.OffloadTier`): its flat byte buffers by name (``k_rows``,
    ``v_rows``; uint8), which the native gather reads directly, once ``fill(first, counts)``
    has filled in (decoded) the record ranges read."""

    buffers: Mapping[str, torch.Tensor]

    def fill(self, first: torch.Tensor, counts: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class RecordIndex:
    """Where each span's records lie in the offload tier, and how they decode. Tensors are
    (N,) int64 on the host, one entry per span."""

    starts: torch.Tensor  # each span's first context position
    lengths: torch.Tensor  # its tokens (records per (layer, KV head))
    # its records of (layer, head) start at record0 + (layer * H + head) * stride: its part
    # holds (L, H, rows, record), stride rows per (layer, head), parts one after another
    record0: torch.Tensor
    stride: torch.Tensor
    num_kv_heads: int
    context_len: int  # positions are clamped below it
    codes: Mapping[str, RecordCode]  # "k" and "v"


def reconstruct(
    reader: OffloadReader,
    index: RecordIndex,
    layer: int,
    spans: torch.Tensor,
    heads: torch.Tensor,
    *,
    rope: Rope | None,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level K, V of (span, head) pairs (``spans``, ``heads``: (n,) host tensors) of one
    layer, flat in pair order: (T, D) each in ``dtype`` on ``device``, T the pairs' total length.

    Keys are rotated to their positions by ``rope``; without one they stay pre-RoPE (bounded
    memories rotate them where the pool places them).
    """
    if isinstance(reader, HeldRecords):  # decoded on first read
        reader.fill(first_records(index, layer, spans, heads), index.lengths[spans])
    gathered = _gathered(reader, index, layer, spans, heads)
    order = None
    if gathered is None:
        if heads.numel() > 1 and not bool((heads[1:] >= heads[:-1]).all()):
            order = heads.argsort(stable=True)  # the codebook decodes rows grouped by head
            spans, heads = spans[order], heads[order]
        ranges, along = record_ranges(index, layer, spans, heads)
        # each KV head's rows (the pairs are grouped by head), one host copy for both kinds
        head_rows = ranges.counts.new_zeros(index.num_kv_heads).index_add_(0, heads, ranges.counts)
        head_rows = head_rows.tolist()
        k_records, v_records = (records(reader, index, kind, ranges) for kind in ("k", "v"))
        pos = index.starts[spans].repeat_interleave(ranges.counts) + along
        pos = pos.clamp(max=index.context_len - 1)
    else:
        k_records, v_records, pos, head_rows = gathered
    keys = decoded(index, "k", layer, k_records, head_rows, dtype, device)  # pre-RoPE
    if rope is not None:
        keys = rope.rotate(keys, pos)
    values = decoded(index, "v", layer, v_records, head_rows, dtype, device)
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
    reader: OffloadReader,
    index: RecordIndex,
    layer: int,
    spans: torch.Tensor,
    heads: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | None:
    """The pairs' records, positions and rows per head read in one native call
    (:func:`sekv_core.native.kernels.gather`) from a tier held whole, or None where the tensor code
    reads them."""
    if not isinstance(reader, HeldRecords):  # read per range (a streamed build's part files)
        return None
    k_buf, v_buf = reader.buffers["k_rows"], reader.buffers["v_rows"]
    tables = (spans, heads, index.record0, index.stride, index.lengths, index.starts)
    if not (
        all(t.dtype == torch.long for t in tables)
        and k_buf.dtype == v_buf.dtype == torch.uint8
        and kernels.usable(*tables, k_buf, v_buf)
    ):
        return None
    k_bytes, v_bytes = index.codes["k"].record_bytes, index.codes["v"].record_bytes
    return kernels.gather(index, layer, spans, heads, k_buf, v_buf, k_bytes, v_bytes)


def first_records(
    index: RecordIndex, layer: int, spans: torch.Tensor, heads: torch.Tensor
) -> torch.Tensor:
    """(n,) each (span, head) pair's first record of ``layer`` in the flat offload buffers."""
    return index.record0[spans] + (layer * index.num_kv_heads + heads) * index.stride[spans]


def record_ranges(
    index: RecordIndex, layer: int, spans: torch.Tensor, heads: torch.Tensor
) -> tuple[RecordRanges, torch.Tensor]:
    """The records of (span, head) pairs of ``layer`` in a flat offload buffer of records
    (``<kind>_rows``; the same for both kinds), and each record's place in its span (T,)."""
    counts = index.lengths[spans]
    first = first_records(index, layer, spans, heads)
    starts = torch.cumsum(counts, 0) - counts  # each pair's first row among all T rows
    pair = torch.repeat_interleave(counts)  # (T,) each row's pair
    along = torch.arange(pair.numel()) - starts[pair]
    return RecordRanges(first, counts, first[pair] + along), along


def records(
    reader: OffloadReader, index: RecordIndex, kind: str, ranges: RecordRanges
) -> torch.Tensor:
    """(T, bytes) records of one kind at ``ranges`` (:func:`record_ranges`), in one read."""
    return reader.offload_records(f"{kind}_rows", index.codes[kind].record_bytes, ranges)


def decoded(
    index: RecordIndex,
    kind: str,
    layer: int,
    records: torch.Tensor,
    head_rows: list[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """(T, D) rows of one kind of ``layer`` from their ``records``, grouped by KV head,
    ``head_rows`` of each; keys pre-RoPE, in ``dtype`` on ``device``. Decoded at once on the
    host (where the records and the codebook are)."""
    rows = index.codes[kind].decode(records, layer, head_rows, dtype)
    return rows.to(device, non_blocking=True)
