"""Zoom-in reconstruction: token-level K/V of (span, head) pairs from the offload tier.

All pairs of one layer are read from the offload tier at once per tensor kind: a raw span's rows
as stored; factorised spans' coefficients and bases scattered into zero-padded blocks and
multiplied in one batched product. A trained rank gate may cut a factorised span's rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .basis import padded_blocks
from .rope import rotate_half

if TYPE_CHECKING:  # the memory passes itself in; this module only reads its tables
    from .zoom import SpanMemory

RankGate = Callable[[str, int, torch.Tensor, torch.Tensor], torch.Tensor]
"""(kind, layer, heads (n,), spectra (n, r)) -> ranks (n,) to reconstruct at."""


class Reconstructor:
    """Reconstructs spans of a :class:`~sekv_core.zoom.SpanMemory`; counts the ranks it used."""

    def __init__(self) -> None:
        self.rank_gate: RankGate | None = None  # trained: decides per pair how many ranks
        self.rank_sum = {"k": 0, "v": 0}  # ranks used by factorised reconstructions
        self.rank_count = {"k": 0, "v": 0}

    def reset(self) -> None:
        self.rank_sum, self.rank_count = {"k": 0, "v": 0}, {"k": 0, "v": 0}

    def mean_rank(self, kind: str) -> float | None:
        """Mean rank of the factorised (non-raw) reconstructions so far."""
        n = self.rank_count[kind]
        return round(self.rank_sum[kind] / n, 2) if n else None

    def reconstruct(
        self, mem: SpanMemory, layer: int, spans: torch.Tensor, heads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-level K, V of (span, head) pairs (``spans``, ``heads``: (n,) host tensors) of
        one layer, flat in pair order: (T, D) each in the model dtype, T the pairs' total length.

        Keys are rotated to their positions (bounded memories: kept pre-RoPE, rotated where the
        pool places them). All pairs' factors are read from the offload tier at once per
        tensor kind (raw spans: their rows as stored; factorised ones: one batched product).
        """
        lengths = mem.ends[spans] - mem.starts[spans]  # (n,)
        pair = torch.repeat_interleave(torch.arange(spans.numel()), lengths)  # (T,) host
        keys = self._rows(mem, "k", layer, spans, heads, lengths, pair)  # pre-RoPE
        if not mem.bounded:
            within = torch.arange(pair.numel()) - (torch.cumsum(lengths, 0) - lengths)[pair]
            pos = (mem.starts[spans][pair] + within).clamp(max=mem.context_len - 1)
            cos, sin = mem.rope.tables(pos, keys)
            keys = keys * cos + rotate_half(keys) * sin
        values = self._rows(mem, "v", layer, spans, heads, lengths, pair)
        return keys, values

    def _rows(
        self,
        mem: SpanMemory,
        kind: str,
        layer: int,
        spans: torch.Tensor,
        heads: torch.Tensor,
        lengths: torch.Tensor,
        pair: torch.Tensor,
    ) -> torch.Tensor:
        """(T, D) rows of one kind for (span, head) pairs of ``lengths`` (``pair``: each row's
        pair), in the model dtype on the device.

        The pairs' coefficient rows are read from the offload tier in one call: a raw span's are
        its rows. Factorised spans' coefficients and bases are scattered into zero-padded
        (m, M, R) and (m, R, D) blocks and multiplied in one batched product; a rank gate
        (trained) decides per pair how many of the stored ranks to use.
        """
        t, D, device, dtype = mem.tables, mem.head_dim, mem.device, mem.dtype
        rank = t[f"{kind}_rank"][layer, heads, spans].long()
        raw = t[f"{kind}_raw"][layer, heads, spans].bool()
        start = t[f"{kind}_coef_off"][layer, heads, spans].long()
        flat = mem.store.offload_ranges(f"{kind}_coef", start, start + lengths * rank)
        if bool(raw.all()):  # the common case: stored rows, nothing to multiply
            return flat.view(-1, D).to(device=device, dtype=dtype, non_blocking=True)
        out = torch.empty(pair.numel(), D, device=device, dtype=dtype)
        element = torch.repeat_interleave(raw, lengths * rank)  # (elements,) of a raw pair
        raw_rows = raw[pair].to(device)
        out[raw_rows] = flat[element].view(-1, D).to(device=device, dtype=dtype)
        low = ~raw
        m, r, n = int(low.sum()), rank[low], lengths[low]
        M, R = int(n.max()), int(r.max())
        coef = padded_blocks(flat[~element], n, r, (m, M, R))
        b0 = t[f"{kind}_basis_off"][layer, heads[low], spans[low]].long()
        flat = mem.store.offload_ranges(f"{kind}_basis", b0, b0 + r * D)
        basis = padded_blocks(flat, r, torch.full_like(r, D), (m, R, D))
        if self.rank_gate is not None:  # coef = U diag(s): column norms are the spectrum
            sigma = coef.float().norm(dim=1)  # (m, R), 0-padded
            r = torch.minimum(self.rank_gate(kind, layer, heads[low], sigma), r)
            basis[torch.arange(R)[None, :] >= r[:, None]] = 0
        coef = coef.to(device=device, dtype=dtype, non_blocking=True)
        basis = basis.to(device=device, dtype=dtype, non_blocking=True)
        real = (torch.arange(M)[None, :] < n[:, None]).to(device)  # (m, M)
        out[~raw_rows] = (coef @ basis)[real]
        self.rank_sum[kind] += int(r.sum())
        self.rank_count[kind] += m
        return out
