import pytest
import torch

from sekv_core.codec import Codebook
from sekv_core.errors import SekvError
from sekv_core.summary import gather_spans, summarize
from sekv_core.tiers import parse_tiers, record_bytes


def spans_data(seed=0, L=2, H=3, T=300, D=16):
    g = torch.Generator().manual_seed(seed)
    # a few strong directions plus noise and an offset, like real keys
    x = torch.randn(L, H, T, 4, generator=g) @ torch.randn(L, H, 4, D, generator=g)
    x = x + 0.1 * torch.randn(L, H, T, D, generator=g) + 0.5
    starts = torch.tensor([0, 20, 70, 71, 150, 230])
    ends = torch.tensor([20, 70, 71, 150, 230, 300])
    return x, starts, ends


def decode_all(code: Codebook, records: torch.Tensor) -> torch.Tensor:
    """Rows (L, H, S, D) of records (L, H, S, B), one layer at a time, every head at once."""
    L, H, S, B = records.shape
    heads = torch.arange(H).repeat_interleave(S)
    return torch.stack(
        [code.decode(records[i].reshape(H * S, B), i, heads, torch.float32) for i in range(L)]
    ).view(L, H, S, -1)


@pytest.mark.parametrize("dim", [16, 64])
def test_16_bit_directions_reconstruct_exactly(dim):
    x, _, _ = spans_data(D=dim)
    code = Codebook.fit(x, f"{dim}x16")
    records = code.encode(x)
    assert records.dtype == torch.uint8 and records.shape == (*x.shape[:-1], 2 * dim)
    assert torch.allclose(decode_all(code, records), x, atol=2e-3 * x.abs().max(), rtol=0)


def test_error_falls_with_bits_and_records_are_the_size_the_spec_says():
    x, _, _ = spans_data(1, D=16)
    errors = []
    for spec in ("16x2", "16x4", "16x8", "16x16", "4x8,12x4"):
        code = Codebook.fit(x, spec)
        records = code.encode(x)
        assert records.shape[-1] == code.record_bytes == record_bytes(parse_tiers(spec))
        errors.append(float((decode_all(code, records) - x).norm() / x.norm()))
    assert errors[:4] == sorted(errors[:4], reverse=True) and errors[3] < 1e-3
    # the strongest directions carry most of a row: 4 of them at 8 bits beat all at 4 bits
    assert errors[4] < errors[1]
    # 4-bit records: 8 bytes of codes + one fp16 scale for 16 numbers (32 bytes in fp16)
    assert Codebook.fit(x, "16x4").record_bytes == 10


def test_a_span_decodes_alone():
    """Rows decode independently: a span's rows read on their own give what decoding the whole
    layer gives for them (what a zoom reads)."""
    x, starts, ends = spans_data(2)
    code = Codebook.fit(x, "4x8,8x4,4x2")
    records = code.encode(x)
    whole = decode_all(code, records)
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        rows = records[1, 2, s:e]
        alone = code.decode(rows, 1, torch.full((e - s,), 2), torch.float32)
        assert torch.allclose(alone, whole[1, 2, s:e], atol=1e-5, rtol=1e-5)


def test_codebook_round_trips_through_its_tensors_and_dropped_directions_cost_nothing():
    x, _, _ = spans_data(3)
    code = Codebook.fit(x, "8x8,8x0")
    again = Codebook.from_tensors(code.tensors("k"), "k", "8x8,8x0")
    assert torch.equal(again.encode(x), code.encode(x))
    assert code.record_bytes == 8 + 2  # the last 8 directions are not stored
    empty = Codebook.fit(x[:, :, :0], "16x8")  # no rows: still a codebook
    assert empty.encode(x[:, :, :0]).shape == (2, 3, 0, 18)


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("16", "COUNTxBITS"),
        ("16x3", "bits must be one of"),
        ("3x4", "whole bytes"),
        ("16x0", "keep no direction"),
        ("8x8,4x4", "cover 12 directions"),
    ],
)
def test_tier_specs_that_cannot_work_are_refused_with_the_reason(spec, reason):
    x, _, _ = spans_data(D=16)
    with pytest.raises(SekvError, match=reason):
        Codebook.fit(x, spec, "store.key_code")


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
