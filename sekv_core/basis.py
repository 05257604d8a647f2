"""Span summaries and low-rank SVD bases of span keys / values, packed flat for the offload tier.

For a span S with token-level matrix X (|S| x d) of one layer and KV head, X = U diag(s) V^T
(V and s^2 from the eigendecomposition of the d x d Gram matrix X^T X).
The stored factorisation keeps ``coef = U_r diag(s_r)`` (|S| x r) and ``basis = V_r^T`` (r x d),
with r the smallest rank holding ``energy`` of the spectrum's squared mass. Storage r(|S| + d)
numbers; when that is not smaller than |S| d the span is stored raw (``coef = X``, no basis).

All spans of all heads are factorised in one batched solve per layer (spans zero-padded to the
longest; padding rows add nothing to the spectrum). The variable-size pieces are packed into flat
fp16 buffers in (layer, head, span) order, addressed by offset tables.
"""

from __future__ import annotations

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
    for layer in range(L):  # one batched solve per layer bounds memory; batched over heads, spans
        x = blocks[layer].float()  # (H, N, M, D)
        # right singular vectors and s^2 from the D x D Gram matrix (2x faster than svd here)
        evals, evecs = torch.linalg.eigh(x.transpose(-1, -2) @ x)  # (H, N, D), (H, N, D, D)
        s2, v = evals.flip(-1).clamp(min=0), evecs.flip(-1)  # descending
        share = s2.cumsum(-1) / s2.sum(-1, keepdim=True).clamp(min=1e-12)
        rank = ((share < energy).sum(-1) + 1).clamp(max=D)  # (H, N)
        raw = rank * (lengths + D) >= lengths * D  # factorisation not smaller than raw
        rank = torch.where(raw, torch.full_like(rank, D), rank)
        coef_full = torch.where(raw[..., None, None], x, x @ v)  # x @ v = U diag(s)
        cols = torch.arange(D)[None, None, None, :] < rank[..., None, None]  # (H, N, 1, D)
        coef_parts.append(coef_full[rows & cols].to(BASIS_DTYPE))  # row-major |S| x r blocks
        vh = v.transpose(-1, -2)  # (H, N, D, D): row i is the i-th basis vector
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
