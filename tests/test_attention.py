"""Mixed-resolution attention: exactness at full zoom, hand-checked coarse attention, budgets."""

import math

import pytest
import torch

from sekv_core.attention import ZoomPolicy, mixed_attention, sekv_attention
from sekv_core.documents import load_document
from sekv_core.methods import MethodSettings, SeKV
from sekv_core.prompt import chat_template, encode_context, encode_question
from sekv_core.router import ROUTERS
from sekv_core.segment import SegmentSettings
from sekv_core.store import StoreSettings

TEXT = " ".join(
    f"Item {i} is kept in room {i * 7 % 31} of the {['north', 'east'][i % 2]} wing."
    for i in range(45)
)
LOSSLESS = StoreSettings(
    key_energy=1.0, value_energy=1.0, segment=SegmentSettings(min_len=8, max_len=32)
)


def sekv_method(loaded, tmp_path, store_settings=LOSSLESS, **settings):
    path = tmp_path / "doc.md"
    path.write_text(TEXT)
    document = load_document(path)
    ctx = encode_context(loaded.tokenizer, chat_template(loaded.tokenizer), document.text)
    method = SeKV(
        loaded,
        document,
        ctx,
        MethodSettings(
            extra={"store_settings": store_settings, **settings.pop("extra", {})}, **settings
        ),
    )
    method.prepare()
    return method, ctx


def sekv_logits(method, q_ids, policy):
    """Logits of every question position through the sekv attention."""
    model = method.loaded.model
    method.spans.clear(capacity=policy.budget * method.spans.num_kv_heads)
    pos = torch.arange(len(q_ids))[None] + len(method.context)
    with torch.inference_mode(), sekv_attention(model):
        out = model(
            input_ids=torch.tensor([q_ids]),
            position_ids=pos,
            sekv_memory=method.spans,
            sekv_policy=policy,
        )
    return out.logits[0]


def test_every_span_zoomed_at_full_rank_equals_full_attention(tiny_loaded, tmp_path):
    method, ctx = sekv_method(tiny_loaded, tmp_path)
    q_ids = encode_question(
        tiny_loaded.tokenizer, chat_template(tiny_loaded.tokenizer), "Which room keeps item 12?"
    )
    assert method.spans.n_spans > 5
    everything = ZoomPolicy(router=ROUTERS["sketch"](), budget=10**6, margin=math.inf)
    got = sekv_logits(method, q_ids, everything)
    with torch.inference_mode():
        ref = tiny_loaded.model(input_ids=torch.tensor([ctx.ids + q_ids])).logits[0, len(ctx) :]
    # K/V are stored in fp16 (the store's precision); logits agree to that tolerance
    assert torch.allclose(got, ref, atol=2e-3, rtol=0), (got - ref).abs().max()
    assert everything.trace.zoomed_tokens_max == int(method.spans.lengths.sum())


def test_no_zoom_equals_hand_computed_coarse_attention():
    torch.manual_seed(0)
    Hkv, G, Tq, Tl, D, F, N = 2, 3, 4, 6, 8, 5, 7
    q = torch.randn(Hkv, G, Tq, D)
    k_loc, v_loc = torch.randn(Hkv, Tl, D), torch.randn(Hkv, Tl, D)
    fixed_k, fixed_v = torch.randn(Hkv, F, D), torch.randn(Hkv, F, D)
    sum_k, sum_v = torch.randn(Hkv, N, D), torch.randn(Hkv, N, D)
    log_len = torch.rand(N) * 3
    k_mem = torch.cat([fixed_k, sum_k], 1)
    v_mem = torch.cat([fixed_v, sum_v], 1)
    bias = torch.cat([torch.zeros(Hkv, F), log_len.expand(Hkv, N)], 1)
    scale = D**-0.5
    out, mass = mixed_attention(q, k_loc, v_loc, k_mem, v_mem, bias, scale)
    for h in range(Hkv):
        for g in range(G):
            for t in range(Tq):
                logits = [q[h, g, t] @ k * scale for k in fixed_k[h]]
                logits += [q[h, g, t] @ k * scale + log_len[n] for n, k in enumerate(sum_k[h])]
                visible = Tl - Tq + t  # causal inside the local window
                logits += [q[h, g, t] @ k_loc[h, j] * scale for j in range(visible + 1)]
                w = torch.stack(logits).softmax(0)
                vals = torch.cat([fixed_v[h], sum_v[h], v_loc[h, : visible + 1]])
                assert torch.allclose(out[h, g, t], w @ vals, atol=1e-5)
    assert mass.shape == (Hkv, F + N)


def test_reconstruction_equals_basis_product(tiny_loaded, tmp_path):
    lossy = StoreSettings(
        key_energy=0.8, value_energy=0.8, segment=SegmentSettings(min_len=16, max_len=32)
    )
    method, _ = sekv_method(tiny_loaded, tmp_path, store_settings=lossy)
    spans, store = method.spans, method.store
    spans.clear(capacity=10**6)
    t = store.resident
    from safetensors.torch import load_file

    flat = load_file(store.path / "offload.safetensors")
    D = spans.head_dim
    checked = 0
    for layer in range(spans.num_layers):
        for span in range(spans.n_spans):
            for head in range(spans.num_kv_heads):
                s, e = int(t["span_starts"][span]), int(t["span_ends"][span])
                r = int(t["v_rank"][layer, head, span])
                c0 = int(t["v_coef_off"][layer, head, span])
                coef = flat["v_coef"][c0 : c0 + (e - s) * r].view(e - s, r).float()
                if t["v_raw"][layer, head, span]:
                    expect = coef
                else:
                    b0 = int(t["v_basis_off"][layer, head, span])
                    expect = coef @ flat["v_basis"][b0 : b0 + r * D].view(r, D).float()
                    checked += 1
                _, v = spans.span_kv(layer, span, head)
                assert torch.allclose(v.float(), expect, atol=2e-3)
    assert checked > 0  # some spans really are low-rank


@pytest.mark.parametrize("budget", [24, 60])
def test_budget_never_exceeded(tiny_loaded, tmp_path, budget):
    method, _ = sekv_method(tiny_loaded, tmp_path, budget=budget, extra={"margin": math.inf})
    tok = tiny_loaded.tokenizer
    q = encode_question(tok, chat_template(tok), "Where is item 4 kept?")
    list(method.generate(q, 6))
    policy = method.policy
    assert 0 < policy.trace.zoomed_tokens_max <= budget
    per_layer = method.spans.capacity
    assert all(tokens <= per_layer for tokens in method.spans.cache_tokens)
    assert method.memory()["zoom_peak_bytes"] > 0


def test_oracle_recall_is_measured(tiny_loaded, tmp_path):
    method, _ = sekv_method(tiny_loaded, tmp_path, budget=40, measure_recall=True)
    tok = tiny_loaded.tokenizer
    list(method.generate(encode_question(tok, chat_template(tok), "Where is item 4?"), 3))
    routing = method.routing()
    assert 0.0 <= routing["recall_vs_oracle"] <= 1.0
    # the oracle against itself is perfect
    oracle, _ = sekv_method(tiny_loaded, tmp_path, budget=40, measure_recall=True, router="oracle")
    list(oracle.generate(encode_question(tok, chat_template(tok), "Where is item 4?"), 3))
    assert oracle.routing()["recall_vs_oracle"] == 1.0


def test_routing_with_the_sketchs_first_directions_is_a_smaller_sketch(tiny_loaded, tmp_path):
    """The first d of a store's sketch directions are exactly a d-dim store's sketch (strongest
    first, one scale per direction): placing only them routes like the smaller store and the
    rest is not resident."""
    from sekv_core.sketch import sketch_logits

    segment = SegmentSettings(min_len=8, max_len=32)
    wide, _ = sekv_method(tiny_loaded, tmp_path, StoreSettings(segment=segment))
    narrow, _ = sekv_method(tiny_loaded, tmp_path, StoreSettings(segment=segment, sketch_dim=8))
    full = wide.spans.sketch_dims
    assert full > 8 and narrow.spans.sketch_dims == 8
    before = wide.spans.resident_bytes()
    wide.spans.place_sketch(8)
    assert wide.spans.routed_dims == 8
    # what leaves the device: the other directions' projection (fp16), scales and 4-bit rows
    L, H, S = wide.spans.sketch.shape[:3]
    D = wide.spans.head_dim
    gone = (full - 8) * (L * H * D * 2 + L * H * 2 + L * H * S // 2)
    assert before - wide.spans.resident_bytes() == gone
    q = torch.randn(H, 2, 3, D, generator=torch.Generator().manual_seed(0))
    for layer in range(L):
        a = sketch_logits(wide.spans, layer, q)
        b = sketch_logits(narrow.spans, layer, q)
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)
    wide.spans.place_sketch()
    assert wide.spans.resident_bytes() == before


def test_a_starved_zoom_routes_with_half_the_sketch(tiny_loaded, tmp_path):
    """Under a memory target that would leave the zoom fewer than STARVED_ZOOM tokens, the
    answer places half the sketch and zooms more; a loose target keeps the whole sketch."""
    from sekv_core.methods.sekv import STARVED_ZOOM

    segment = SegmentSettings(min_len=8, max_len=32)
    method, _ = sekv_method(tiny_loaded, tmp_path, StoreSettings(segment=segment))
    spans, full = method.spans, method.spans.sketch_dims
    spec = tiny_loaded.spec
    kv = spec.kv_bytes(len(method.context), 2)
    per_token = spec.kv_bytes(1, 2) * (1 + 2 / spec.num_layers)
    spans.place_sketch()
    whole = spans.resident_bytes()
    # a target leaving the whole sketch exactly one token short of the starved line
    method.settings.memory_ratio = (whole + (STARVED_ZOOM - 1) * per_token) / kv
    budget = method.zoom_budget()
    assert spans.routed_dims == full // 2 and budget > STARVED_ZOOM - 1
    assert budget == int((method.settings.memory_ratio * kv - spans.resident_bytes()) // per_token)
    method.settings.memory_ratio = (whole + (STARVED_ZOOM + 1) * per_token) / kv
    assert method.zoom_budget() >= STARVED_ZOOM and spans.routed_dims == full
