import pytest
import torch

from sekv_core.basis import factorize, gather_spans, reconstruct, summarize


def spans_data(seed=0, L=2, H=3, T=300, D=16):
    g = torch.Generator().manual_seed(seed)
    # low-rank structure plus noise, like real keys
    x = torch.randn(L, H, T, 4, generator=g) @ torch.randn(L, H, 4, D, generator=g)
    x = x + 0.1 * torch.randn(L, H, T, D, generator=g)
    starts = torch.tensor([0, 20, 70, 71, 150, 230])
    ends = torch.tensor([20, 70, 71, 150, 230, 300])
    return x, starts, ends


def unpack(pb, x, starts, ends, prefix="k"):
    L, H, _, D = x.shape
    tables = pb.tables(prefix)
    out = torch.zeros_like(x)
    for layer in range(L):
        for head in range(H):
            for n, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
                out[layer, head, s:e] = reconstruct(
                    pb.coef, pb.basis, tables, prefix, layer, head, n, e - s, D
                )
    return out


@pytest.mark.parametrize("dim", [16, 64])
def test_full_rank_reconstructs_exactly(dim):
    x, starts, ends = spans_data(D=dim)
    pb = factorize(gather_spans(x, starts, ends), ends - starts, energy=1.0)
    rec = unpack(pb, x, starts, ends)
    assert torch.allclose(rec, x, atol=5e-3 * x.abs().max(), rtol=0)  # fp16 storage


def test_error_falls_as_rank_rises_and_storage_never_exceeds_raw():
    x, starts, ends = spans_data(1)
    lengths = ends - starts
    D = x.shape[-1]
    errors = []
    for energy in (0.5, 0.8, 0.95, 0.999):
        pb = factorize(gather_spans(x, starts, ends), lengths, energy)
        errors.append(float((unpack(pb, x, starts, ends) - x).norm() / x.norm()))
        stored = lengths * pb.rank + torch.where(pb.raw, 0, pb.rank * D)  # (L, H, N)
        assert (stored <= lengths * D).all()
        assert pb.coef.numel() == int((lengths * pb.rank).sum())
        # the 1-token span can never be compressed: stored raw
        assert pb.raw[:, :, 2].all()
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < 0.05


def test_summaries():
    x, starts, ends = spans_data(2)
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
