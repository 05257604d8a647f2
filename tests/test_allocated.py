"""The allocated offload code (sekv_core.allocated): fixed-size records, error within what the
bits allow, spent where the queries look."""

import pytest
import torch

from sekv_core.allocated import AllocatedCode, query_metric
from sekv_core.codec import fit_code, load_code
from sekv_core.config import KEY_CODE, VALUE_CODE, MethodSettings, SegmentSettings, StoreSettings
from sekv_core.documents import load_document
from sekv_core.errors import SekvError
from sekv_core.methods import SeKV
from sekv_core.prompt import chat_template, encode_context
from sekv_core.tiers import check_code, parse_alloc


def rows_data(seed=0, L=2, H=3, S=400, D=16):
    """Rows with a decaying spectrum along random directions, an offset and a few outliers."""
    g = torch.Generator().manual_seed(seed)
    rot = torch.linalg.qr(torch.randn(D, D, generator=g))[0]
    x = (torch.randn(L, H, S, D, generator=g) * torch.logspace(0, -2, D)) @ rot + 0.3
    x[:, :, ::97] *= 6  # a few atypical rows
    return x


def decode_all(code, records):
    L, H, S, B = records.shape
    heads = torch.arange(H).repeat_interleave(S)
    layers = [code.decode(records[i].reshape(H * S, B), i, heads, torch.float32) for i in range(L)]
    return torch.stack(layers).view(L, H, S, -1)


def weighted_error(x, y, metric):
    """Relative squared error in the metric (what attention logits see of a key's error)."""
    m = metric[:, :, None]
    return float(((x - y).square() * m).sum() / (x.square() * m).sum())


def test_records_have_the_size_the_spec_says_and_error_falls_with_bits():
    x = rows_data()
    metric = torch.ones(2, 3, 16)
    errors = []
    for bits in (2, 3, 4, 6, 8):
        row_bits = parse_alloc(f"alloc:{bits}", 16)
        code = AllocatedCode.fit(x, row_bits, metric)
        records = code.encode(x)
        # never larger than raw rows at the same bits: a record is bits x D
        assert records.dtype == torch.uint8 and records.shape == (2, 3, 400, bits * 16 // 8)
        assert int(code.bits.sum(-1).max()) <= row_bits
        errors.append(weighted_error(x, decode_all(code, records), metric))
    assert errors == sorted(errors, reverse=True)
    assert errors[2] < 5e-3 and errors[-1] < 5e-4


def test_a_span_decodes_alone_and_the_code_round_trips_through_its_tensors():
    x = rows_data(1)
    code = fit_code(x, "alloc:4", moment=torch.eye(16).expand(2, 3, 16, 16))
    records = code.encode(x)
    whole = decode_all(code, records)
    again = load_code({k: v.clone() for k, v in code.tensors("k").items()}, "k", "alloc:4")
    assert torch.equal(again.encode(x), records)
    for s, e in ((0, 7), (7, 12), (200, 208)):
        alone = again.decode(records[1, 2, s:e], 1, torch.full((e - s,), 2), torch.float32)
        assert torch.allclose(alone, whole[1, 2, s:e], atol=1e-5, rtol=1e-5)


def test_bits_go_where_the_queries_look():
    """Keys read through q.k: weighting the dimensions by the queries' energy lowers the error
    attention sees, at the same bits."""
    x = rows_data(2)
    D = x.shape[-1]
    energy = torch.ones(D)
    energy[[3, 3 + D // 2]] = 400.0  # one RoPE pair the queries look along
    moment = torch.diag(energy).expand(2, 3, D, D)
    metric = query_metric(moment, x)
    assert torch.equal(metric[0, 0, 3], metric[0, 0, 3 + D // 2])
    weighted = fit_code(x, "alloc:3", moment=moment)
    plain = fit_code(x, "alloc:3")
    seen = [weighted_error(x, decode_all(c, c.encode(x)), metric) for c in (weighted, plain)]
    assert seen[0] < 0.5 * seen[1]


def test_rows_with_no_tokens_still_make_a_code():
    x = rows_data()[:, :, :0]
    code = fit_code(x, "alloc:4")
    assert code.encode(x).shape == (2, 3, 0, 8)


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("alloc:x", "must be a number"),
        ("alloc:0.5", "within 1..8"),
        ("alloc:4.1", "whole number of bytes"),
    ],
)
def test_alloc_specs_that_cannot_work_are_refused_with_the_reason(spec, reason):
    with pytest.raises(SekvError, match=reason):
        fit_code(rows_data(D=16), spec, "store.key_code")
    if reason != "whole number of bytes":
        with pytest.raises(ValueError, match=reason):
            check_code(spec)  # settings refuse it before any model is loaded


def test_a_store_in_the_default_code_reconstructs_its_spans_keys_within_the_codes_error(
    tiny_loaded, tmp_path
):
    """The default store (even codes): every span's keys and values rebuilt from the offload
    tier are the document's own within the code's error, and the tier is what its codes say:
    every span token's records at the codes' bits, never more than 8 bits per number."""
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
    key_bytes = load_code(store.resident, "k", KEY_CODE).record_bytes
    value_bytes = load_code(store.resident, "v", VALUE_CODE).record_bytes
    assert store.manifest["stats"]["key_bits"] == round(8 * key_bytes / coded.head_dim, 3)
    assert store.manifest["stats"]["value_bits"] == round(8 * value_bytes / coded.head_dim, 3)
    assert max(key_bytes, value_bytes) <= coded.head_dim  # never larger than 8-bit raw rows
    tier = store.offload  # the records as answers read them (decoded from the file)
    assert tier["k_rows"].numel() == L * H * tokens * key_bytes  # every span token's, no more
    assert tier["v_rows"].numel() == L * H * tokens * value_bytes
    spans, heads = torch.arange(N).repeat(H), torch.arange(H).repeat_interleave(N)
    for layer in range(L):
        keys, values = coded.reconstruct(layer, spans, heads)
        true_keys, true_values = exact.reconstruct(layer, spans, heads)
        for got, want in ((keys, true_keys), (values, true_values)):
            err = (got.float() - want.float()).norm() / want.float().norm()
            assert 0 < err < 0.1, (layer, float(err))
