"""Span summaries and low-rank SVD bases of span keys / values, packed flat for the offload tier.

For a span S with token-level matrix X (|S| x d) of one layer and KV head, X = U diag(s) V^T
(from the eigendecomposition of the smaller Gram matrix, X X^T or X^T X).
The stored factorisation keeps ``coef = U_r diag(s_r)`` (|S| x r) and ``basis = V_r^T`` (r x d),
with r the smallest rank holding ``energy`` of the spectrum's squared mass. Storage r(|S| + d)
numbers; when that is not smaller than |S| d the span is stored raw (``coef = X``, no basis).

All spans of all heads are factorised in one batched solve per layer (spans zero-padded to the
longest; padding rows add nothing to the spectrum). The variable-size pieces are packed into flat
fp16 buffers in (layer, head, span) order, addressed by offset tables.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

BASIS_DTYPE = torch.float16


@dataclass
class PackedBasis:
    """Low-rank factors of one tensor kind (keys or values) for every (layer, head, span).

    coef, basis : flat BASIS_DTYPE buffers (offload tier)
    rank : (L, H, N) int32; equals d for raw spans
    raw : (L, H, N) bool; span stored as its raw matrix in ``coef``
    coef_off, basis_off : (L, H, N) int64 element offsets into the flat buffers
    """

    coef: torch.Tensor
    basis: torch.Tensor
    rank: torch.Tensor
    raw: torch.Tensor
    coef_off: torch.Tensor
    basis_off: torch.Tensor

    def tables(self, prefix: str) -> dict[str, torch.Tensor]:
        """The small per-span tables (resident tier)."""
        return {
            f"{prefix}_rank": self.rank,
            f"{prefix}_raw": self.raw.to(torch.uint8),
            f"{prefix}_coef_off": self.coef_off,
            f"{prefix}_basis_off": self.basis_off,
        }


def gather_spans(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Zero-padded span blocks: (..., T, D) -> (..., N, M, D) with M the longest span."""
    lengths = ends - starts
    width = int(lengths.max()) if len(lengths) else 0
    pos = starts[:, None] + torch.arange(width)[None]  # (N, M)
    valid = torch.arange(width)[None] < lengths[:, None]  # (N, M)
    blocks = x[..., pos.clamp(max=x.shape[-2] - 1), :]  # (..., N, M, D)
    return blocks * valid[..., None].to(x.dtype)


def summarize(
    keys: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Span summaries from padded blocks.

    keys, values : (..., N, M, D) padded span blocks; weights : (N, M) surprisal (0 on padding)
    Returns the surprisal-weighted mean key, rescaled to the span's mean key norm, and the mean
    value, each (..., N, D).
    """
    valid = (torch.arange(keys.shape[-2])[None] < lengths[:, None]).to(keys.dtype)  # (N, M)
    w = weights.clamp(min=0) * valid
    w = torch.where(w.sum(-1, keepdim=True) > 0, w, valid)
    w = w / w.sum(-1, keepdim=True)  # (N, M)
    mean_k = (w[..., None] * keys).sum(-2)  # (..., N, D)
    mean_norm = (keys.norm(dim=-1) * valid).sum(-1) / lengths.to(keys.dtype)  # (..., N)
    summary_k = mean_k * (mean_norm / mean_k.norm(dim=-1).clamp(min=1e-6))[..., None]
    summary_v = values.sum(-2) / lengths.to(values.dtype)[:, None]
    return summary_k, summary_v


def factorize(blocks: torch.Tensor, lengths: torch.Tensor, energy: float) -> PackedBasis:
    """Adaptive-rank SVD of padded span blocks (L, H, N, M, D); see the module docstring."""
    L, H, N, M, D = blocks.shape
    coef_parts, basis_parts, ranks, raws = [], [], [], []
    rows = torch.arange(M)[None, None, :, None] < lengths[None, :, None, None]  # (1, N, M, 1)
    widths = _bucket_widths(lengths, M)  # (N,)
    for layer in range(L):  # one batched solve per layer bounds memory; batched over heads, spans
        x = blocks[layer].float()  # (H, N, M, D)
        s2, us, vh = _spectrum(x, widths)
        share = s2.cumsum(-1) / s2.sum(-1, keepdim=True).clamp(min=1e-12)
        rank = ((share < energy).sum(-1) + 1).clamp(max=D)  # (H, N)
        raw = rank * (lengths + D) >= lengths * D  # factorisation not smaller than raw
        rank = torch.where(raw, torch.full_like(rank, D), rank)
        coef_full = torch.where(raw[..., None, None], x, us)
        cols = torch.arange(D)[None, None, None, :] < rank[..., None, None]  # (H, N, 1, D)
        coef_parts.append(coef_full[rows & cols].to(BASIS_DTYPE))  # row-major |S| x r blocks
        brows = torch.arange(D)[None, None, :, None] < torch.where(raw, 0, rank)[..., None, None]
        basis_parts.append(vh[brows.expand_as(vh)].to(BASIS_DTYPE))  # row-major r x D blocks
        ranks.append(rank)
        raws.append(raw)
    rank = torch.stack(ranks).to(torch.int32)  # (L, H, N)
    raw = torch.stack(raws)
    coef_size = (lengths * rank).to(torch.int64)
    basis_size = torch.where(raw, 0, rank * D).to(torch.int64)
    return PackedBasis(
        coef=torch.cat(coef_parts),
        basis=torch.cat(basis_parts),
        rank=rank,
        raw=raw,
        coef_off=_exclusive_cumsum(coef_size),
        basis_off=_exclusive_cumsum(basis_size),
    )


def _bucket_widths(lengths: torch.Tensor, most: int) -> torch.Tensor:
    """Padded width per span: the next power of two >= its length (at most ``most``)."""
    pow2 = 2 ** torch.ceil(torch.log2(lengths.clamp(min=1).double())).long()
    return pow2.clamp(max=most)


def _spectrum(
    x: torch.Tensor, widths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """s^2, U diag(s) and V^T of each (head, span) block, padded to D, spectrum descending.

    x : (H, N, M, D). Spans are solved in buckets of equal padded width w: through the w x w
    Gram matrix X X^T when w < D (eigh costs w^3), else through the D x D matrix X^T X.
    Returns s2 (H, N, D), us (H, N, M, D), vh (H, N, D, D).
    """
    H, N, M, D = x.shape
    s2, us, vh = x.new_zeros(H, N, D), x.new_zeros(H, N, M, D), x.new_zeros(H, N, D, D)
    for w in widths.unique().tolist():  # a handful of buckets, each one batched solve
        idx = torch.nonzero(widths == w)[:, 0]
        xb = x[:, idx, :w]  # (H, n, w, D)
        if w < D:
            ev, u = torch.linalg.eigh(xb @ xb.transpose(-1, -2))  # (H, n, w), (H, n, w, w)
            ev, u = ev.flip(-1).clamp(min=0), u.flip(-1)
            sv = ev.sqrt()
            s2[:, idx, :w] = ev
            us[:, idx, :w, :w] = u * sv[..., None, :]
            vh[:, idx, :w] = (u.transpose(-1, -2) @ xb) / sv.clamp(min=1e-12)[..., None]
        else:
            ev, v = torch.linalg.eigh(xb.transpose(-1, -2) @ xb)  # (H, n, D), (H, n, D, D)
            ev, v = ev.flip(-1).clamp(min=0), v.flip(-1)
            s2[:, idx] = ev
            us[:, idx, :w] = xb @ v
            vh[:, idx] = v.transpose(-1, -2)
    return s2, us, vh


def _exclusive_cumsum(sizes: torch.Tensor) -> torch.Tensor:
    flat = sizes.flatten()
    return (flat.cumsum(0) - flat).view(sizes.shape)


def reconstruct(
    coef: torch.Tensor,
    basis: torch.Tensor,
    tables: dict[str, torch.Tensor],
    prefix: str,
    layer: int,
    head: int,
    span: int,
    length: int,
    dim: int,
) -> torch.Tensor:
    """Token-level (|S|, D) matrix of one (layer, head, span) from the packed factors."""
    r = int(tables[f"{prefix}_rank"][layer, head, span])
    c0 = int(tables[f"{prefix}_coef_off"][layer, head, span])
    c = coef[c0 : c0 + length * r].view(length, r).float()
    if tables[f"{prefix}_raw"][layer, head, span]:
        return c
    b0 = int(tables[f"{prefix}_basis_off"][layer, head, span])
    return c @ basis[b0 : b0 + r * dim].view(r, dim).float()


def padded_blocks(
    flat: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shape: tuple[int, int, int]
) -> torch.Tensor:
    """Zero-padded blocks ``shape`` (n, A, B) from ``flat``: block i's rows[i] x cols[i]
    row-major elements, one block after another."""
    sizes = rows * cols
    block = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)  # (total,)
    within = torch.arange(flat.numel()) - (torch.cumsum(sizes, 0) - sizes)[block]
    out = flat.new_zeros(shape)
    out[block, within // cols[block], within % cols[block]] = flat
    return out


@contextmanager
def one_thread() -> Iterator[None]:
    """Run a block on one intra-op thread: batches of small eigendecompositions are up to 100x
    slower with several (the batch loop and LAPACK compete for the cores), worst on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
