"""Mixed-resolution attention: exactness at full zoom, hand-checked coarse attention, budgets."""

import math
from dataclasses import replace

import pytest
import torch

from sekv_core.config import MethodSettings, SegmentSettings, StoreSettings
from sekv_core.documents import load_document
from sekv_core.methods import SeKV
from sekv_core.prompt import chat_template, encode_context, encode_question
from sekv_core.rope import Rope
from sekv_core.zoom.attention import ZoomPolicy, mixed_attention, sekv_attention, widen
from sekv_core.zoom.memory import SpanMemory
from sekv_core.zoom.router import SketchRouter

TEXT = " ".join(
    f"Item {i} is kept in room {i * 7 % 31} of the {['north', 'east'][i % 2]} wing."
    for i in range(45)
)
LOSSLESS = StoreSettings(
    key_code="*x16", value_code="*x16", segment=SegmentSettings(min_len=8, max_len=32)
)


def sekv_method(loaded, tmp_path, store_settings=LOSSLESS, kv_bits=8, **settings):
    """A prepared SeKV; ``kv_bits`` 16 holds token-level K/V in fp16 (exactness checks)."""
    path = tmp_path / "doc.md"
    path.write_text(TEXT)
    document = load_document(path)
    ctx = encode_context(loaded.tokenizer, chat_template(loaded.tokenizer), document.text)
    method = SeKV(loaded, document, ctx, MethodSettings(store=store_settings, **settings))
    method.prepare()
    if kv_bits != 8:
        store = method.store
        method.spans = SpanMemory(store, Rope(loaded.model), loaded.device, loaded.dtype, kv_bits)
    return method, ctx


def sekv_logits(method, q_ids, policy):
    """Logits of every question position through the sekv attention."""
    model = method.loaded.model
    method.spans.clear()
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
    method, ctx = sekv_method(tiny_loaded, tmp_path, kv_bits=16)
    q_ids = encode_question(
        tiny_loaded.tokenizer, chat_template(tiny_loaded.tokenizer), "Which room keeps item 12?"
    )
    assert method.spans.n_spans > 5
    everything = ZoomPolicy(router=SketchRouter(), budget=10**6, margin=math.inf)
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
    expected_mass = torch.zeros(Hkv, Tq, F + N)
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
                expected_mass[h, t] += w[: F + N]
    # per query: the memory entries' attention summed over the group's heads
    assert torch.allclose(mass, expected_mass, atol=1e-5)


def test_reconstruction_decodes_each_spans_own_records(tiny_loaded, tmp_path):
    """One batched reconstruction of every (span, head) pair of a layer, pairs in any order,
    gives each pair the rows its own records in the offload file decode to, and those rows
    are the document's values within the code's rounding."""
    lossy = StoreSettings(segment=SegmentSettings(min_len=16, max_len=32))  # the default codes
    method, _ = sekv_method(tiny_loaded, tmp_path, store_settings=lossy, kv_bits=16)
    lossless = replace(lossy, key_code="*x16", value_code="*x16")  # the same spans
    exact, _ = sekv_method(tiny_loaded, tmp_path, store_settings=lossless, kv_bits=16)
    spans, store = method.spans, method.store

    from sekv_core.store.codes import TierCode

    flat = store.tier.whole()["v_rows"]  # (decoded from the file)
    code = TierCode.from_tensors(store.resident.codebooks, "v", "*x4")
    L, N, H = spans.num_layers, spans.n_spans, spans.num_kv_heads
    S, B = int(spans.lengths.sum()), code.record_bytes
    assert flat.numel() == L * H * S * B  # every span token's record, nothing else
    records = flat.view(L, H, S, B)
    pairs = [(span, head) for span in reversed(range(N)) for head in range(H)]  # any order
    for layer in range(L):
        ask = torch.tensor([s for s, _ in pairs]), torch.tensor([h for _, h in pairs])
        _, values = spans.reconstruct(layer, *ask)
        _, truth = exact.spans.reconstruct(layer, *ask)
        at = 0
        for span, head in pairs:
            n = int(spans.lengths[span])
            first = int(spans.first_row[span])
            own = records[layer, head, first : first + n]
            expect = code.decode(own, layer, torch.full((n,), head), torch.float32)
            assert torch.allclose(values[at : at + n].float(), expect, atol=2e-3)
            at += n
        assert at == values.shape[0]
        err = (values.float() - truth.float()).norm() / truth.float().norm()
        assert 0 < err < 0.1  # lossy, but close


def active_rows(pool, head):
    """Head ``head``'s active slots of a pool: their tokens (ascending) and K, V rows."""
    slots = torch.nonzero(pool.active[head])[:, 0]
    tokens, order = pool.token[head, slots].sort()
    keys, values = pool.kv(torch.float32)
    return tokens, keys[head, slots[order]], values[head, slots[order]]


def test_pool_update_reuses_held_spans(tiny_loaded, tmp_path):
    """A layer whose picks change keeps the slots of spans it held and zooms again (nothing is
    reconstructed again) and reconstructs only the new (span, head) pairs; its active slots
    hold exactly the picked spans' tokens, with the K/V a pool built from scratch has."""
    method, _ = sekv_method(tiny_loaded, tmp_path)
    spans = method.spans
    H, N = spans.num_kv_heads, spans.n_spans
    assert N >= 4
    first = torch.zeros(H, N, dtype=torch.bool)
    first[:, :2] = True
    second = first.clone()
    second[0, 3] = True  # one new pair
    second[-1, 0] = False  # one dropped
    budget = int(spans.lengths[:4].sum())
    spans.clear()
    spans.zoom_pool(0, first, budget)
    before = spans.reconstructions
    assert before == 2 * H
    assert spans.zoom_pool(0, first, budget) is spans.zoom_pool(0, first, budget)  # unchanged
    grown = spans.zoom_pool(0, second, budget)
    assert spans.reconstructions - before == 1
    spans.clear()
    fresh = spans.zoom_pool(0, second, budget)
    for h in range(H):
        want = torch.nonzero(second[h])[:, 0]
        rows = [torch.arange(int(spans.lengths[n])) + int(spans.first_row[n]) for n in want]
        tokens = torch.cat(rows)  # the spans' rows of the sketch order
        for a, b in zip(active_rows(grown, h), active_rows(fresh, h), strict=True):
            assert torch.equal(a, b)
        assert torch.equal(active_rows(grown, h)[0], tokens)
        assert torch.equal(
            grown.owner[h][grown.active[h]].sort().values,
            fresh.owner[h][fresh.active[h]].sort().values,
        )


def test_pool_keeps_dropped_spans_while_room_lasts(tiny_loaded, tmp_path):
    """A span dropped for a step and picked again comes back without a reconstruction while
    the pool has free slots; in a full pool the least recently active span gives way."""
    method, _ = sekv_method(tiny_loaded, tmp_path)
    spans = method.spans
    H, N = spans.num_kv_heads, spans.n_spans
    pick = [torch.zeros(H, N, dtype=torch.bool) for _ in range(3)]
    pick[0][:, [0, 1]] = True
    pick[1][:, [0, 2]] = True
    pick[2][:, [0, 1]] = True
    lengths = spans.lengths
    for budget, again in ((int(lengths[:3].sum()), 0), (int(lengths[:2].max() + lengths[0]), H)):
        spans.clear()
        for zoom in pick[:2]:
            spans.zoom_pool(0, zoom, budget)
        before = spans.reconstructions
        pool = spans.zoom_pool(0, pick[2], budget)
        assert spans.reconstructions - before == again
        assert pool.owner.shape[1] <= max(budget, int(lengths[[0, 2]].sum()))
        for h in range(H):
            assert set(pool.owner[h][pool.active[h]].tolist()) == {0, 1}


def test_widen_gives_each_span_the_best_score_of_its_neighbours():
    inf = math.inf
    scores = torch.tensor([[0.0, 1.0, 5.0, 2.0, -inf, -inf, 3.0], [4.0, -inf, -inf, -inf, 0, 0, 1]])
    assert torch.equal(widen(scores, 0), scores)
    assert widen(scores, 1).tolist() == [
        [1.0, 5.0, 5.0, 5.0, 2.0, 3.0, 3.0],
        [4.0, 4.0, -inf, 0.0, 0.0, 1.0, 1.0],
    ]
    assert widen(scores, 2)[0].tolist() == [5.0, 5.0, 5.0, 5.0, 5.0, 3.0, 3.0]
    assert widen(scores[:, :1], 3).tolist() == [[0.0], [4.0]]


@pytest.mark.parametrize("budget", [24, 60])
def test_budget_never_exceeded(tiny_loaded, tmp_path, budget):
    method, _ = sekv_method(tiny_loaded, tmp_path, budget=budget, margin=math.inf)
    tok = tiny_loaded.tokenizer
    q = encode_question(tok, chat_template(tok), "Where is item 4 kept?")
    list(method.generate(q, 6))
    policy = method.policy
    assert 0 < policy.trace.zoomed_tokens_max <= budget
    pools = method.spans.pools.values()
    assert pools and all(pool.owner.shape[1] <= budget for pool in pools)
    assert all((pool.active.sum(dim=1) <= budget).all() for pool in pools)
    assert method.memory()["zoom_peak_bytes"] > 0


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


def test_the_placed_sketch_is_column_major_and_routes_as_its_rows(tiny_loaded, tmp_path):
    """The sketch routing reads holds each (layer, head)'s code columns contiguous (the routing
    products read them along every row), as the one copy a loaded store keeps (a part of it
    placed: in the same layout), and routes exactly as the row-major rows."""
    from sekv_core.sketch import sketch_logits

    segment = SegmentSettings(min_len=4, max_len=8)
    method, _ = sekv_method(tiny_loaded, tmp_path, StoreSettings(segment=segment))
    memory = method.spans
    L, H, S, cols = memory.sketch.shape
    assert S > cols
    assert all(memory.sketch[layer].transpose(-1, -2).is_contiguous() for layer in range(L))
    assert memory.sketch.data_ptr() == memory.store.resident.sketch.data_ptr()  # no 2nd copy
    memory.place_sketch(memory.sketch_dims // 2)
    assert memory.sketch.shape[-1] == cols // 2
    assert all(memory.sketch[layer].transpose(-1, -2).is_contiguous() for layer in range(L))
    memory.place_sketch()
    placed, rows = memory.sketch, memory.sketch.contiguous()
    assert torch.equal(placed, rows)
    q = torch.randn(H, 2, 1, memory.head_dim, generator=torch.Generator().manual_seed(1))
    router = SketchRouter()
    for layer in range(L):
        a, scores_a = sketch_logits(memory, layer, q), router.scores(memory, layer, q, 0.125)
        memory.sketch = rows
        b, scores_b = sketch_logits(memory, layer, q), router.scores(memory, layer, q, 0.125)
        memory.sketch = placed
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)
        assert torch.allclose(scores_a, scores_b, rtol=1e-5, atol=1e-4)


def test_a_starved_zoom_routes_with_half_the_sketch(tiny_loaded, tmp_path):
    """Under a memory target that would leave the zoom less than STARVED_SHARE of the span
    tokens, the answer places half the sketch and zooms more; a looser target keeps it whole."""
    from sekv_core.methods.sekv import STARVED_SHARE

    segment = SegmentSettings(min_len=8, max_len=32)
    method, _ = sekv_method(tiny_loaded, tmp_path, StoreSettings(segment=segment), budget=10**6)
    spans, full = method.spans, method.spans.sketch_dims
    line = math.ceil(STARVED_SHARE * spans.span_tokens)
    kv = tiny_loaded.spec.kv_bytes(len(method.context), 2)
    fixed, per_token = method.zoom_costs()
    spans.place_sketch()
    whole = spans.resident_bytes() + fixed
    # a target leaving the whole sketch exactly one token short of the starved line
    method.settings.memory_share = (whole + (line - 1) * per_token) / kv
    budget = method.zoom_budget()
    assert spans.routed_dims == full // 2 and budget > line - 1
    left = method.settings.memory_share * kv - spans.resident_bytes() - fixed
    assert budget == max(32, int(left // per_token))
    method.settings.memory_share = (whole + (line + 1) * per_token) / kv
    assert method.zoom_budget() >= line and spans.routed_dims == full


def test_a_memory_target_caps_the_zoom_and_does_not_fill_it(tiny_loaded, tmp_path):
    """A memory target lowers the zoom budget where it leaves less than ``budget`` (default
    ``DEFAULT_BUDGET``); a looser one leaves the budget as it is, and the answer's measured
    memory stays within the target either way."""
    from sekv_core.config import DEFAULT_BUDGET
    from sekv_core.methods.sekv import STARVED_SHARE

    store = StoreSettings(segment=SegmentSettings(min_len=8, max_len=32))
    method, ctx = sekv_method(tiny_loaded, tmp_path, store, memory_share=1.0)
    spans, s = method.spans, method.settings
    line = math.ceil(STARVED_SHARE * spans.span_tokens)  # above it: the whole sketch routes
    kv = tiny_loaded.spec.kv_bytes(len(ctx), 2)
    fixed, per_token = method.zoom_costs()
    spans.place_sketch()
    left = int((kv - spans.resident_bytes() - fixed) // per_token)  # what a 100% target leaves
    assert left > line + 20
    assert method.zoom_budget() == min(DEFAULT_BUDGET, left)
    s.budget = line + 20
    assert method.zoom_budget() == line + 20  # loose target: the budget
    s.memory_share = (spans.resident_bytes() + fixed + (line + 5.5) * per_token) / kv
    assert method.zoom_budget() == line + 5 and spans.routed_dims == spans.sketch_dims
    tok = tiny_loaded.tokenizer
    list(method.generate(encode_question(tok, chat_template(tok), "Where is item 4?"), 4))
    assert method.policy.budget == line + 5
    assert method.memory()["resident_bytes"] <= s.memory_share * kv


def test_eight_bit_zoom_rounds_each_row_by_at_most_half_a_step(tiny_loaded, tmp_path):
    """8-bit zoom: every reconstructed row reads back within half its scale of the 16-bit one,
    and a zoomed head-token costs int8 K + V and two fp16 scales."""
    lossy = StoreSettings(segment=SegmentSettings(min_len=16, max_len=32))  # the default codes
    exact, _ = sekv_method(tiny_loaded, tmp_path, store_settings=lossy, kv_bits=16)
    coarse, _ = sekv_method(tiny_loaded, tmp_path, store_settings=lossy)
    assert coarse.spans.kv_bits == 8
    assert coarse.spans.token_bytes == 2 * (coarse.spans.head_dim + 2)
    assert exact.spans.token_bytes == 4 * exact.spans.head_dim
    every = torch.ones(coarse.spans.num_kv_heads, coarse.spans.n_spans, dtype=torch.bool)
    worst = 0.0
    for layer in range(coarse.spans.num_layers):
        for spans in (exact.spans, coarse.spans):
            spans.clear()
        fine = exact.spans.zoom_pool(layer, every, exact.spans.span_tokens)
        rounded = coarse.spans.zoom_pool(layer, every, coarse.spans.span_tokens)
        assert torch.equal(fine.owner, rounded.owner)
        for a, b in ((fine.rows, rounded.rows),):  # K and V
            want = a.read(torch.float32)
            got = b.read(torch.float32)
            step = b.scale.float()[..., None]
            # half a step, plus the fp16 rounding of the 16-bit reference
            err = (got - want).abs() - want.abs() * 2**-10
            assert (err <= step / 2 + 1e-7).all()
            assert b.codes.dtype == torch.int8 and b.codes.abs().max() <= 127
            worst = max(worst, float((got - want).abs().max()))
    assert worst > 0  # it really is rounded


def test_eight_bit_zoom_doubles_the_tokens_a_memory_target_allows(tiny_loaded, tmp_path):
    """Same target, same resident tier: the 8-bit zoom reconstructs ~2x the tokens, and the
    answer's measured resident memory stays within the target."""
    segment = SegmentSettings(min_len=8, max_len=32)
    store = StoreSettings(segment=segment)
    budgets, peaks = {}, {}
    for bits in (16, 8):
        method, ctx = sekv_method(
            tiny_loaded,
            tmp_path,
            store,
            memory_share=0.6,
            budget=10**6,  # what the target allows (a budget caps it)
            kv_bits=bits,
            margin=math.inf,
        )
        tok = tiny_loaded.tokenizer
        list(method.generate(encode_question(tok, chat_template(tok), "Where is item 4?"), 4))
        budgets[bits] = method.policy.budget
        kv = tiny_loaded.spec.kv_bytes(len(ctx), 2)
        peaks[bits] = method.memory()["resident_bytes"] / kv
        assert method.policy.trace.zoomed_tokens_max > 0
    # per head-token and layer: K + V at 2 bytes a number vs 1 + a 2-byte scale per row; one
    # layer's entries in the model dtype (fp32 here) cost the same either way: with 2 layers
    # that copy weighs much more than with the default model's 30 (there: 1.84x)
    L, D = tiny_loaded.spec.num_layers, tiny_loaded.spec.head_dim
    copy = 2 * D * tiny_loaded.dtype.itemsize
    ratio = (4 * D * (L + 2) + copy) / (2 * (D + 2) * (L + 2) + copy)
    assert ratio > 1.3 and budgets[8] >= 0.97 * ratio * budgets[16], (budgets, ratio)
    assert peaks[8] <= 0.6 and peaks[16] <= 0.6, peaks
