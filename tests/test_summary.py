"""Span summaries (:mod:`sekv_core.summary`): the surprisal-weighted key at the span's mean key
norm and the mean value, from zero-padded span blocks."""

import torch

from sekv_core.summary import gather_spans, summarize


def test_summaries():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 300, 16, generator=g) + 0.5
    starts = torch.tensor([0, 20, 70, 71, 150, 230])
    ends = torch.tensor([20, 70, 71, 150, 230, 300])
    lengths = ends - starts
    blocks = gather_spans(x, starts, ends)
    w = torch.zeros(len(starts), blocks.shape[-2])
    w[:, 0] = 1.0  # all weight on each span's first token
    sk, sv = summarize(blocks, blocks, w, lengths)
    first = x[:, :, starts]  # (L, H, N, D)
    mean_norm = torch.stack(
        [x[:, :, s:e].norm(dim=-1).mean(-1) for s, e in zip(starts, ends, strict=True)], -1
    )
    expect = first / first.norm(dim=-1, keepdim=True) * mean_norm[..., None]
    assert torch.allclose(sk, expect, atol=1e-4)
    means = torch.stack([x[:, :, s:e].mean(-2) for s, e in zip(starts, ends, strict=True)], -2)
    assert torch.allclose(sv, means, atol=1e-5)
