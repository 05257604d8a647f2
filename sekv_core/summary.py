"""Span summaries (the coarse tier's one entry per span), the store's half precision, and a
one-thread block for batches of small solves.

A span's summary is the surprisal-weighted mean of its keys, rescaled to their mean norm, and the
mean of its values; both are computed from zero-padded span blocks (:func:`gather_spans`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

STORE_DTYPE = torch.float16  # what the store keeps in half precision


def stored(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a store keeps it (half precision), in float32: a code is fitted, encoded and
    decoded with the same numbers."""
    return t.to(STORE_DTYPE).float()


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


@contextmanager
def one_thread() -> Iterator[None]:
    """Run a block on one intra-op thread: with several, the batch loop of small
    eigendecompositions and LAPACK compete for the cores (see docs/design.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
