import pytest
import torch

from sekv_core.prefill import prefill
from sekv_core.sketch import QueryMoments, dequantize_sketch, quantize_sketch, sketch_basis


def estimate(basis, q, keys):
    """(q A) . ((k - mu) B) + q . mu for queries q (L, H, Tq, D), keys (L, H, S, D)."""
    qs = q @ basis.query_proj
    return qs @ basis.project(keys).transpose(-1, -2) + (q @ basis.mean[..., None])


def psd(g, L, H, D):
    a = torch.randn(L, H, D, D, generator=g)
    return a @ a.transpose(-1, -2) + 0.1 * torch.eye(D)


@pytest.mark.parametrize("weighted", [False, True])
def test_a_full_dimension_sketch_gives_exact_logits(weighted):
    g = torch.Generator().manual_seed(0)
    L, H, S, D = 2, 3, 40, 8
    keys = torch.randn(L, H, S, D, generator=g) + 3.0  # far from centred
    q = torch.randn(L, H, 5, D, generator=g)
    basis = sketch_basis(keys, psd(g, L, H, D) if weighted else None, D)
    assert torch.allclose(estimate(basis, q, keys), q @ keys.transpose(-1, -2), atol=1e-3)


def test_query_weighting_keeps_the_key_directions_queries_read():
    """Keys vary most along e0, which queries never read; logits vary along e1. One dimension:
    key PCA keeps e0 and loses the logits, the query-weighted sketch keeps e1."""
    g = torch.Generator().manual_seed(1)
    L, H, S, D = 1, 1, 400, 6
    keys = 0.01 * torch.randn(L, H, S, D, generator=g)
    keys[..., 0] += 10 * torch.randn(L, H, S, generator=g)
    keys[..., 1] += torch.randn(L, H, S, generator=g)
    q = torch.zeros(L, H, 300, D)
    q[..., 1] = torch.randn(L, H, 300, generator=g)
    q[..., 2:] = 0.01 * torch.randn(L, H, 300, D - 2, generator=g)
    moments = QueryMoments()
    moments.add(0, q[0], num_kv_heads=1)
    exact = q @ keys.transpose(-1, -2)

    def error(basis):
        return (estimate(basis, q, keys) - exact).pow(2).mean()

    plain, weighted = sketch_basis(keys, None, 1), sketch_basis(keys, moments.moment(), 1)
    assert error(weighted) < 0.01 * error(plain)
    assert error(weighted) < 0.01 * exact.pow(2).mean()


def test_query_moments_sum_chunks_and_survive_a_checkpoint():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(6, 20, 4, generator=g)  # 6 query heads = 2 KV groups of 3
    whole, parts = QueryMoments(), QueryMoments()
    whole.add(0, q, num_kv_heads=2)
    parts.add(0, q[:, :7], num_kv_heads=2)
    parts.add(0, q[:, 7:], num_kv_heads=2)
    assert torch.allclose(whole.moment(), parts.moment(), atol=1e-5)
    again = QueryMoments.from_state(parts.state())
    assert torch.allclose(again.moment(), whole.moment(), atol=1e-5)
    group = q[:3].reshape(-1, 4)
    assert torch.allclose(whole.moment()[0, 0], group.T @ group / group.shape[0], atol=1e-5)
    assert QueryMoments().moment() is None and QueryMoments().state() == {}


@pytest.mark.parametrize("bits", [4, 8])
def test_sketch_quantisation_round_trip(bits):
    x = torch.randn(2, 3, 50, 32)
    q = quantize_sketch(x, bits)
    back = dequantize_sketch(q["sketch"], 32, torch.float32) * q["sketch_scale"][:, :, None].float()
    step = x.abs().amax(dim=2, keepdim=True) / (2 ** (bits - 1) - 1)
    assert ((back - x).abs() <= step / 2 + 1e-3).all()
    assert q["sketch"].numel() * q["sketch"].element_size() == x.numel() * bits // 8


def test_prefill_query_moments_do_not_depend_on_the_chunking(tiny_loaded):
    """Chunks attend causally to the cache (a custom attention gets no mask by default)."""
    ids = list(range(5, 125))
    one = prefill(tiny_loaded.model, ids, chunk=1000)
    chunked = prefill(tiny_loaded.model, ids, chunk=16)
    spec = tiny_loaded.spec
    L, H, D, D2 = one.query_moment.shape
    assert (L, H) == (spec.num_layers, spec.num_kv_heads) and D == D2
    assert torch.allclose(one.query_moment, chunked.query_moment, rtol=1e-4, atol=1e-5)
    assert torch.allclose(
        torch.from_numpy(one.surprisal), torch.from_numpy(chunked.surprisal), atol=1e-4
    )
