"""The offload tier's codes (:mod:`sekv_core.store.codes`): values at 4 bits with a row scale,
or fp16 (:class:`TierCode`), keys on one even grid per (layer, KV head) (:class:`EvenCode`);
records of the size their specs say, rows back within each code's error, a span's rows decoded
alone; the specs each kind accepts (:mod:`sekv_core.code_specs`)."""

import numpy as np
import pytest
import torch

import sekv_core.native.kernels as kernels
from sekv_core.code_specs import check_code, tier_record_bytes
from sekv_core.config import KEY_CODE, VALUE_CODE, MethodSettings, SegmentSettings, StoreSettings
from sekv_core.documents import load_document
from sekv_core.errors import SekvError
from sekv_core.methods import SeKV
from sekv_core.native.build import library
from sekv_core.prompt import chat_template, encode_context
from sekv_core.store.codes import (
    EvenCode,
    TierCode,
    fit_code,
    load_code,
    on_grid,
    query_metric,
)


def low_rank_rows(seed=0, L=2, H=3, S=300, D=16):
    """A few strong directions plus noise and an offset, like real values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, H, S, 4, generator=g) @ torch.randn(L, H, 4, D, generator=g)
    return x + 0.1 * torch.randn(L, H, S, D, generator=g) + 0.5


def heavy_rows(L=2, H=3, S=1500, D=64, seed=0):
    """Rows whose directions' strengths spread 30x, with outlying rows (as real keys have)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.linalg.qr(torch.randn(D, D, generator=g))[0]
    rows = (torch.randn(L, H, S, D, generator=g) * torch.linspace(3, 0.1, D)) @ mix
    rows[:, :, :: S // 10] *= 6  # a few rows far outside the rest
    return rows + 0.5


def decode_all(code, records: torch.Tensor) -> torch.Tensor:
    """Rows (L, H, S, D) of records (L, H, S, B), one layer at a time, every head at once."""
    L, H, S, B = records.shape
    heads = torch.arange(H).repeat_interleave(S)
    layers = [code.decode(records[i].reshape(H * S, B), i, heads, torch.float32) for i in range(L)]
    return torch.stack(layers).view(L, H, S, -1)


def even_coefficients(code: EvenCode, rows: torch.Tensor, layer: int) -> torch.Tensor:
    """Rows' coefficients (H, S, D) on the code's directions, in its metric."""
    y = (rows[layer] - code.mean[layer][:, None]) * code.metric[layer].sqrt()[:, None]
    return y @ code.basis[layer]


def weighted_error(x: torch.Tensor, y: torch.Tensor, metric: torch.Tensor) -> float:
    """Relative squared error in the metric (what attention logits see of a key's error)."""
    m = metric[:, :, None]
    return float(((x - y).square() * m).sum() / (x.square() * m).sum())


# ---- TierCode (values) ----------------------------------------------------------------------


@pytest.mark.parametrize("dim", [16, 64])
def test_16_bit_directions_reconstruct_exactly(dim):
    x = low_rank_rows(D=dim)
    code = TierCode.fit(x, 16)
    records = code.encode(x)
    assert records.dtype == torch.uint8 and records.shape == (*x.shape[:-1], 2 * dim)
    assert torch.allclose(decode_all(code, records), x, atol=2e-3 * x.abs().max(), rtol=0)


def test_tier_error_falls_with_bits_and_records_are_the_size_the_spec_says():
    x = low_rank_rows(1)
    errors = []
    for spec, bits in (("*x4", 4), ("*x16", 16)):
        code = fit_code(x, spec)
        records = code.encode(x)
        assert records.shape[-1] == code.record_bytes == tier_record_bytes(bits, 16)
        errors.append(float((decode_all(code, records) - x).norm() / x.norm()))
    assert errors[1] < 1e-3 < errors[0] < 0.2
    # 4-bit records: 8 bytes of codes + one fp16 scale for 16 numbers (32 bytes in fp16)
    assert fit_code(x, "*x4").record_bytes == 10


def test_a_small_row_keeps_its_relative_error():
    """One fp16 scale per row and tier: a row 1000x smaller than the rest comes back to the
    same relative error as they do."""
    x = low_rank_rows(4)
    x[0, 0, 7] = x[0, 0, 7] * 1e-3 + x[0, 0].mean(dim=0) * (1 - 1e-3)  # near the mean
    code = fit_code(x, "*x4")
    got = decode_all(code, code.encode(x))
    centred = (x - code.mean[:, :, None]).norm(dim=-1)
    rel = (got - x).norm(dim=-1) / centred
    assert float(rel[0, 0, 7]) < 2 * float(rel.median())


def test_tier_code_round_trips_through_its_tensors():
    x = low_rank_rows(3)
    code = fit_code(x, "*x4")
    tensors = {k: t.clone() for k, t in code.tensors("v").items()}
    assert tensors["v_basis"].dtype == torch.int8  # the basis in 8 bits, on its own grid
    again = load_code(tensors, "v", "*x4")
    assert isinstance(again, TierCode) and torch.equal(again.basis, code.basis)
    assert torch.equal(again.encode(x), code.encode(x))
    empty = fit_code(x[:, :, :0], "*x16")  # no rows: still a code
    assert empty.encode(x[:, :, :0]).shape == (2, 3, 0, 32)


@pytest.mark.parametrize("spec", ["16x8,48x4", "8x8,24x4,32x2", "*x2", "*x8", "16x16", "*x4 "])
def test_specs_that_are_not_codes_are_refused_naming_the_setting(spec):
    with pytest.raises(SekvError, match="store.value_code: .*not a tier code"):
        fit_code(low_rank_rows(D=16), spec, "store.value_code")


@pytest.mark.parametrize(
    "spec, kind",
    [("even:0.175", "key"), ("*x16", "key"), ("*x4", "value"), ("*x16", "value")],
)
def test_each_kind_takes_its_shipped_code_and_the_lossless_one(spec, kind):
    check_code(spec, kind)


@pytest.mark.parametrize(
    "spec, kind, reason",
    [
        ("*x4", "key", "not a key code: use even:S"),
        ("16x8,48x4", "key", "not a key code"),
        ("even:0.2", "value", r"not a value code: use \*x4 or \*x16"),
        ("8x8,*x4", "value", "not a value code"),
    ],
)
def test_a_code_of_the_other_kind_or_an_old_tier_list_is_refused(spec, kind, reason):
    with pytest.raises(ValueError, match=reason):
        check_code(spec, kind)


def test_a_basis_is_kept_in_8_bits_each_column_on_its_own_grid():
    """Each column on the finest power-of-two grid that holds it in 8-bit codes: within half
    a step of the exact numbers, exact in fp16, and rounding again changes nothing."""
    g = torch.Generator().manual_seed(7)
    t = torch.randn(2, 3, 16, 16, generator=g) * torch.logspace(-3, 1, 16)  # columns' scales
    once = on_grid(t)
    peak = t.abs().amax(dim=-2, keepdim=True)
    step = torch.exp2(torch.ceil(torch.log2(peak / 127)))  # (2, 3, 1, 16)
    codes = once / step
    assert torch.equal(codes, codes.round()) and float(codes.abs().max()) <= 127
    assert bool(((once - t).abs() <= step / 2).all())
    assert bool((peak > 127 * step / 2).all())  # a finer grid would not hold the column
    assert torch.equal(on_grid(once), once) and torch.equal(once.half().float(), once)


# ---- EvenCode (keys) ------------------------------------------------------------------------


def test_every_row_decodes_within_half_a_step_of_each_direction_none_clipped():
    rows = heavy_rows()
    code = EvenCode.fit(rows, 0.2, query_metric(None, rows))
    got = decode_all(code, code.encode(rows))
    step, levels = code.grid
    for layer in range(rows.shape[0]):
        want, back = even_coefficients(code, rows, layer), even_coefficients(code, got, layer)
        err = (back - want).abs() / step[layer][:, None]  # (H, S, D) in steps
        assert float(err.max()) <= 0.5 + 1e-3  # the outlying rows too: nothing clipped
        even = levels[layer] < 127  # on the head's step (the rest: 8 bits over their range)
        assert 0 < int(even.sum()) < even.numel()
        head = 0.2 * want.square().mean(dim=(1, 2)).sqrt()  # the step the spec asks for
        head = head[:, None].expand_as(step[layer])
        assert torch.allclose(step[layer][even], head[even], rtol=2e-3)
        assert bool((step[layer][~even] >= head[~even] * (1 - 2e-3)).all())


def test_the_layout_is_the_layers_widest_and_strong_directions_get_more_bits():
    rows = heavy_rows()
    code = EvenCode.fit(rows, 0.2, query_metric(None, rows))
    bits = code.bits
    assert torch.equal(bits, bits[:, :1].expand_as(bits))  # a layer's heads share a layout
    assert set(bits.unique().tolist()) <= {0, 2, 3, 4, 5, 6, 7, 8}
    widest = int(bits[:, 0].sum(dim=-1).max())
    assert code.record_bytes == -(-widest // 8) == code.encode(rows).shape[-1]
    assert bool((bits[:, 0, :8].float().mean() > bits[:, 0, -8:].float().mean()).all())


def test_a_direction_beyond_8_bits_keeps_8_on_its_range():
    rows = heavy_rows(L=1, H=1)
    code = EvenCode.fit(rows, 0.01, query_metric(None, rows))  # a step far below the range
    step, levels = code.grid
    assert int(code.bits.max()) == 8 and float(levels.max()) == 127
    capped = levels[0, 0] == 127
    peak = even_coefficients(code, rows, 0).abs().amax(dim=1)[0]
    assert bool((step[0, 0][capped] * 127 >= peak[capped] * (1 - 1e-3)).all())  # its range


def test_even_error_falls_and_records_grow_as_the_step_shrinks():
    rows = heavy_rows(S=600)
    metric = query_metric(None, rows)
    errors, sizes = [], []
    for step in (0.8, 0.4, 0.2, 0.1):
        code = fit_code(rows, f"even:{step}")
        errors.append(weighted_error(rows, decode_all(code, code.encode(rows)), metric))
        sizes.append(code.record_bytes)
    assert errors == sorted(errors, reverse=True) and errors[-1] < 2e-3
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1] <= rows.shape[-1]  # <= 8 bits each


def test_bits_go_where_the_queries_look():
    """Keys read through q.k: weighting the dimensions by the queries' energy puts the error
    where the queries do not look, and at the same step reaches no more error as attention
    sees it in fewer bytes."""
    rows = heavy_rows(S=600, D=16)
    D = rows.shape[-1]
    energy = torch.ones(D)
    energy[[3, 3 + D // 2]] = 400.0  # one RoPE pair the queries look along
    moment = torch.diag(energy).expand(2, 3, D, D)
    metric = query_metric(moment, rows)
    assert torch.equal(metric[0, 0, 3], metric[0, 0, 3 + D // 2])
    weighted = fit_code(rows, "even:0.3", moment=moment)
    plain = fit_code(rows, "even:0.3")
    errors, shares = [], []
    for code in (weighted, plain):
        got = decode_all(code, code.encode(rows))
        errors.append(weighted_error(rows, got, metric))
        per_dim = (got - rows).square().mean(dim=(0, 1, 2))  # (D,)
        rest = torch.ones(D, dtype=torch.bool)
        rest[[3, 3 + D // 2]] = False
        shares.append(float(per_dim[3] / per_dim[rest].mean()))
    assert shares[0] < 0.05 and shares[1] > 0.5  # the looked-at pair: nearly exact
    assert errors[0] <= errors[1] and weighted.record_bytes < plain.record_bytes


def test_even_code_round_trips_through_its_tensors_and_a_span_decodes_alone():
    rows = heavy_rows(S=400)
    code = fit_code(rows, "even:0.3", "store.key_code")
    back = load_code({k: t.clone() for k, t in code.tensors("k").items()}, "k", "even:0.3")
    assert isinstance(back, EvenCode) and back.record_bytes == code.record_bytes
    assert torch.equal(back.bits, code.bits)
    records = code.encode(rows)
    assert torch.equal(back.encode(rows), records)
    whole = decode_all(back, records)
    for s, e in ((0, 7), (7, 12), (200, 208)):
        alone = back.decode(records[1, 2, s:e], 1, torch.full((e - s,), 2), torch.float32)
        # the same numbers up to float32 sums taken in another order (the rows reach ~30)
        scale = float(whole.abs().max())
        assert torch.allclose(alone, whole[1, 2, s:e], atol=1e-5 * scale, rtol=1e-5)


def test_rows_with_no_tokens_still_make_a_code():
    rows = heavy_rows(S=10)[:, :, :0]
    code = fit_code(rows, "even:0.2")
    assert code.encode(rows).shape == (2, 3, 0, 1)  # one byte of unused bits


@pytest.mark.parametrize("spec", ["even:", "even:x", "even:0", "even:9", "alloc:4.5"])
def test_malformed_or_unknown_key_specs_are_refused_with_a_reason(spec):
    with pytest.raises(ValueError, match="step" if spec.startswith("even") else "not a key code"):
        check_code(spec, "key")


# ---- both codes -----------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["native", "tensor-code"])
def test_even_records_are_the_codes_bits_one_after_another(native, monkeypatch):
    """A record holds each direction's code (offset to be non-negative) in its bits, lowest
    first, right after the previous direction's; natively and in the tensor code, decoding
    reads exactly those codes."""
    if native and library() is None:
        pytest.skip("needs the native library (a C compiler)")
    if not native:
        monkeypatch.setattr(kernels, "usable", lambda *tensors: False)
    rows = heavy_rows(L=1, H=2, S=200)
    code = fit_code(rows, "even:0.15")
    step, levels = code.grid
    coef = even_coefficients(code, rows, 0)
    top = levels[0][:, None]  # (H, 1, D)
    want = ((coef / step[0][:, None]).round().clamp(-top, top) + top).long()
    records = code.encode(rows)[0]  # (H, S, B)
    bits = np.unpackbits(records.numpy(), axis=-1, bitorder="little")  # (H, S, 8 B)
    widths = code.bits[0, 0].tolist()
    at, read = 0, []
    for width in widths:
        field = bits[..., at : at + width]
        read.append((field * (1 << np.arange(width))).sum(axis=-1))
        at += width
    assert not bits[..., at:].any()  # the record's unused bits are zero
    assert torch.equal(torch.from_numpy(np.stack(read, axis=-1)), want)
    # what decoding reads: the rows of those codes
    maps, bias = code.synthesis
    expect = torch.stack([want[h].float() @ maps[0, h] + bias[0, h] for h in range(2)])
    got = code.decode(records.reshape(-1, code.record_bytes), 0, [200, 200], torch.float32)
    assert torch.allclose(got.view(2, 200, -1), expect, atol=1e-4, rtol=1e-4)


def test_a_store_in_the_default_codes_reconstructs_its_spans_within_the_codes_error(
    tiny_loaded, tmp_path
):
    """The default store (keys even, values in 4-bit tiers): every span's keys and values
    rebuilt from the offload tier are the document's own within the codes' error, and the tier
    is what its codes say: every span token's records at the codes' bits, never more than 8
    bits per number."""
    text = " ".join(f"Crate {i} holds {i * 13 % 97} jars of plum jam." for i in range(60))
    (tmp_path / "doc.md").write_text(text)
    document = load_document(tmp_path / "doc.md")
    ctx = encode_context(tiny_loaded.tokenizer, chat_template(tiny_loaded.tokenizer), text)
    segment = SegmentSettings(min_len=16, max_len=32)

    def memory(key_code, value_code):
        store = StoreSettings(key_code=key_code, value_code=value_code, segment=segment)
        method = SeKV(tiny_loaded, document, ctx, MethodSettings(store=store))
        method.prepare()
        return method.spans, method.store

    coded, store = memory(KEY_CODE, VALUE_CODE)
    exact, _ = memory("*x16", "*x16")  # the same spans, fp16 rows
    L, H, N = coded.num_layers, coded.num_kv_heads, coded.n_spans
    tokens = int(coded.lengths.sum())
    key_bytes = load_code(store.resident.codebooks, "k", KEY_CODE).record_bytes
    value_bytes = load_code(store.resident.codebooks, "v", VALUE_CODE).record_bytes
    assert store.manifest["stats"]["key_bits"] == round(8 * key_bytes / coded.head_dim, 3)
    assert store.manifest["stats"]["value_bits"] == round(8 * value_bytes / coded.head_dim, 3)
    assert max(key_bytes, value_bytes) <= coded.head_dim  # never larger than 8-bit raw rows
    tier = store.tier.whole()  # the records as answers read them (decoded from the file)
    assert tier["k_rows"].numel() == L * H * tokens * key_bytes  # every span token's, no more
    assert tier["v_rows"].numel() == L * H * tokens * value_bytes
    spans, heads = torch.arange(N).repeat(H), torch.arange(H).repeat_interleave(N)
    for layer in range(L):
        keys, values = coded.reconstruct(layer, spans, heads)
        true_keys, true_values = exact.reconstruct(layer, spans, heads)
        for got, want in ((keys, true_keys), (values, true_values)):
            err = (got.float() - want.float()).norm() / want.float().norm()
            assert 0 < err < 0.1, (layer, float(err))


@pytest.mark.parametrize("spec", ["even:0.175", "*x4"])
def test_a_map_after_decoding_folds_into_the_codes_synthesis(spec):
    """decode(..., then=(P, c)) is the decoded rows mapped, per head, by x @ P + c (what a
    bounded store's sketch rows are computed with)."""
    rows = heavy_rows(S=300)
    code = fit_code(rows, spec, moment=None)
    records = code.encode(rows)
    H, S, B = records.shape[1:]
    g = torch.Generator().manual_seed(3)
    proj, shift = torch.randn(H, 64, 16, generator=g), torch.randn(H, 16, generator=g)
    for layer in range(rows.shape[0]):
        flat = records[layer].reshape(H * S, B)
        keys = code.decode(flat, layer, [S] * H, torch.float32).view(H, S, -1)
        want = keys @ proj + shift[:, None]
        got = code.decode(flat, layer, [S] * H, torch.float32, (proj, shift)).view(H, S, -1)
        assert torch.allclose(got, want, atol=1e-3 * float(want.abs().max()))
