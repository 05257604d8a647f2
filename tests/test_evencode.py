"""The even code (:mod:`sekv_core.evencode`): one step per (layer, KV head), no row clipped,
fewer bytes on disk than the fixed-rate code at the same error, and long books' fixed-size
records keep the fixed-rate codes."""

import pytest
import torch

import sekv_core.rans as rans
from sekv_core.allocated import AllocatedCode, query_metric
from sekv_core.codec import Codebook, fit_code, load_code, record_spec
from sekv_core.config import FIXED_SIZE_CODES
from sekv_core.evencode import fit_even
from sekv_core.format import nbytes
from sekv_core.tiers import check_code


def heavy_rows(L=2, H=3, S=1500, D=64, seed=0):
    """Rows whose directions' strengths spread 30x, with outlying rows (as real keys have)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.linalg.qr(torch.randn(D, D, generator=g))[0]
    rows = (torch.randn(L, H, S, D, generator=g) * torch.linspace(3, 0.1, D)) @ mix
    rows[:, :, :: S // 10] *= 6  # a few rows far outside the rest
    return rows + 0.5


def coefficients(code, rows, layer):
    y = (rows[layer] - code.mean[layer][:, None]) * code.metric[layer].sqrt()[:, None]
    return y @ code.basis[layer]


def decoded(code, rows):
    out = torch.empty_like(rows)
    L, H, S, D = rows.shape
    for layer in range(L):
        records = code.encode_layer(rows[layer], layer).reshape(H * S, -1)
        heads = torch.arange(H).repeat_interleave(S)
        out[layer] = code.decode(records, layer, heads, torch.float32).view(H, S, D)
    return out


def test_every_row_decodes_within_half_a_step_of_each_direction_none_clipped():
    rows = heavy_rows()
    code = fit_even(rows, 0.2, query_metric(None, rows))
    got = decoded(code, rows)
    step, levels = code.grid
    for layer in range(rows.shape[0]):
        want, back = coefficients(code, rows, layer), coefficients(code, got, layer)
        err = (back - want).abs() / step[layer][:, None]  # (H, S, D) in steps
        assert float(err.max()) <= 0.5 + 1e-3  # the outlying rows too: nothing clipped
        even = levels[layer] < 127  # on the head's step (the rest: 8 bits over their range)
        assert 0 < int(even.sum()) < even.numel()
        head = code.step[layer][:, None].expand_as(step[layer])
        assert torch.allclose(step[layer][even], head[even], rtol=2e-3)
        assert bool((step[layer][~even] >= head[~even] * (1 - 2e-3)).all())


def test_the_layout_is_the_layers_widest_and_strong_directions_get_more_bits():
    rows = heavy_rows()
    code = fit_even(rows, 0.2, query_metric(None, rows))
    bits = code.bits
    assert torch.equal(bits, bits[:, :1].expand_as(bits))  # a layer's heads share a layout
    assert set(bits.unique().tolist()) <= {0, 2, 3, 4, 5, 6, 7, 8}
    widest = int(bits[:, 0].sum(dim=-1).max())
    assert code.record_bytes == -(-widest // 8)
    assert bool((bits[:, 0, :8].float().mean() > bits[:, 0, -8:].float().mean()).all())


def test_a_direction_beyond_8_bits_keeps_8_on_its_range():
    rows = heavy_rows(L=1, H=1)
    code = fit_even(rows, 0.01, query_metric(None, rows))  # a step far below the range
    step, levels = code.grid
    assert int(code.bits.max()) == 8 and float(levels.max()) == 127
    capped = levels[0, 0] == 127
    peak = coefficients(code, rows, 0).abs().amax(dim=1)[0]
    assert bool((step[0, 0][capped] * 127 >= peak[capped] * (1 - 1e-3)).all())  # its range


@pytest.mark.skipif(not rans.usable(), reason="needs the native library (a C compiler)")
def test_on_disk_it_is_smaller_than_the_fixed_rate_code_at_no_more_error():
    rows = heavy_rows()
    fixed = AllocatedCode.fit(rows, int(4.5 * 64), query_metric(None, rows))
    even = fit_even(rows, 0.4, query_metric(None, rows))
    sizes, errors = {}, {}
    for name, code in (("fixed", fixed), ("even", even)):
        flat = code.encode(rows).flatten()
        bounds = torch.tensor([0, rows.shape[2]])
        stored = rans.compacted({"k_rows": flat, "v_rows": flat}, bounds, {"k": code, "v": code})
        back = rans.expanded(stored, bounds, {"k": code, "v": code})
        assert torch.equal(back["k_rows"], flat)  # bit for bit
        sizes[name] = nbytes(stored)
        errors[name] = float((decoded(code, rows) - rows).square().mean())
    assert errors["even"] < 0.8 * errors["fixed"]  # (0.050 against 0.067 here)
    assert sizes["even"] < 0.92 * sizes["fixed"]  # (0.88)


def test_stored_tensors_read_back_as_the_same_code():
    rows = heavy_rows(L=1)
    code = fit_code(rows, "even:0.3", "store.key_code")
    back = load_code({k: t.clone() for k, t in code.tensors("k").items()}, "k", "even:0.3")
    assert back.record_bytes == code.record_bytes and torch.equal(back.bits, code.bits)
    assert torch.equal(back.step, code.step.to(torch.float16).float())


def test_fixed_size_records_keep_the_fixed_rate_codes_and_load_as_them():
    rows = heavy_rows(L=1)
    assert record_spec("even:0.2", "k", fixed_size=False) == "even:0.2"
    assert record_spec("alloc:5", "k", fixed_size=True) == "alloc:5"  # only even specs give way
    key = fit_code(rows, record_spec("even:0.2", "k", fixed_size=True), "store.key_code")
    value = fit_code(rows, record_spec("even:0.4", "v", fixed_size=True), "store.value_code")
    assert isinstance(key, AllocatedCode) and key.step is None
    assert key.record_bytes * 8 == 4.5 * 64 and FIXED_SIZE_CODES["k"] == "alloc:4.5"
    assert isinstance(value, Codebook)
    k = load_code(key.tensors("k"), "k", "even:0.2")
    v = load_code(value.tensors("v"), "v", "even:0.4")
    assert k.record_bytes == key.record_bytes and v.record_bytes == value.record_bytes
    records = key.encode(rows)[0].reshape(-1, key.record_bytes)
    heads = torch.arange(3).repeat_interleave(rows.shape[2])
    assert torch.equal(
        k.decode(records, 0, heads, torch.float32), key.decode(records, 0, heads, torch.float32)
    )


@pytest.mark.parametrize("spec", ["even:", "even:x", "even:0", "even:9"])
def test_malformed_even_specs_are_refused_with_a_reason(spec):
    with pytest.raises(ValueError, match="step"):
        check_code(spec)
