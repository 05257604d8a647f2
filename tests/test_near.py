"""Near spans: chosen below the zoom, one softmax entry equal to one entry per span, counted."""

import math

import pytest
import torch
from test_attention import sekv_logits, sekv_method

from sekv_core.attention import ZoomPolicy, mixed_attention
from sekv_core.near import near_count, near_entry, near_spans
from sekv_core.prompt import chat_template, encode_question
from sekv_core.router import ROUTERS
from sekv_core.segment import SegmentSettings
from sekv_core.sketch import sketch_logits
from sekv_core.store import StoreSettings

STORE = StoreSettings(segment=SegmentSettings(min_len=4, max_len=8))


def test_near_spans_are_the_best_scores_the_zoom_left_out():
    inf = float("inf")
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, -inf], [0.0, 9.0, -inf, 7.0, 8.0, 6.0]])
    zoom = torch.tensor([[1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 1, 0]], dtype=torch.bool)
    index, valid = near_spans(scores, zoom, 2)
    assert [sorted(index[h][valid[h]].tolist()) for h in range(2)] == [[1, 2], [3, 5]]
    # more than is left: only spans neither zoomed nor scored -inf (prefiltered away)
    index, valid = near_spans(scores, zoom, 10)
    assert index.shape == (2, 6)
    assert [sorted(index[h][valid[h]].tolist()) for h in range(2)] == [[1, 2, 3, 4], [0, 3, 5]]
    assert near_count(0.0, 256, 6.0) == 0 and near_count(3.0, 0, 6.0) == 0
    assert near_count(3.0, 256, 6.0) == 128 and near_count(0.01, 10, 6.0) == 1


def test_near_entry_is_one_entry_per_span_at_its_tokens_log_sum_exp(tiny_loaded, tmp_path):
    """logit = log-sum-exp of the sketch's estimates over the head's near spans' tokens; value
    = their mean values mixed by each span's share: a softmax with this one entry is a softmax
    with one entry per near span (logit: its tokens' log-sum-exp, value: its mean value)."""
    method, _ = sekv_method(tiny_loaded, tmp_path, STORE)
    memory = method.spans
    H, D, N = memory.num_kv_heads, memory.head_dim, memory.n_spans
    assert N >= 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(H, 2, 3, D, generator=g)
    scores = torch.randn(H, N, generator=g)
    zoom = torch.zeros(H, N, dtype=torch.bool)
    zoom[0, :3] = True
    index, valid = near_spans(scores, zoom, 5)
    scale = D**-0.5
    layer = 1
    logit, value = near_entry(memory, layer, q, scale, index, valid)
    est = sketch_logits(memory, layer, q).float() * scale  # (H, G, Tq, S) every row
    means = memory._summaries["v"][layer].float()  # (H, N, D) the store's mean values
    k_loc, v_loc = torch.randn(H, 4, D, generator=g), torch.randn(H, 4, D, generator=g)
    empty = torch.zeros(H, 0, D)
    out, _ = mixed_attention(
        q, k_loc, v_loc, empty, empty, torch.zeros(H, 0), scale, near=(logit, value)
    )
    for h in range(H):
        spans = index[h][valid[h]].tolist()
        assert len(spans) == 5 and not set(spans) & set(zoom[h].nonzero().flatten().tolist())
        for gi in range(2):
            for t in range(3):
                per_span = [est[h, gi, t][memory.sketch_span == n].logsumexp(0) for n in spans]
                assert float(logit[h, gi, t]) == pytest.approx(
                    float(torch.stack(per_span).logsumexp(0)), abs=1e-4
                )
                # the softmax with one entry per span, by hand
                visible = 4 - 3 + t
                logits = [q[h, gi, t] @ k_loc[h, j] * scale for j in range(visible + 1)]
                w = torch.stack(logits + per_span).softmax(0)
                vals = torch.cat([v_loc[h, : visible + 1], means[h, spans]])
                assert torch.allclose(out[h, gi, t], w @ vals, atol=1e-4)


def test_no_near_span_leaves_attention_as_it_was():
    torch.manual_seed(0)
    H, G, Tq, Tl, D, M = 2, 3, 2, 5, 8, 4
    q = torch.randn(H, G, Tq, D)
    k_loc, v_loc = torch.randn(H, Tl, D), torch.randn(H, Tl, D)
    k_mem, v_mem, bias = torch.randn(H, M, D), torch.randn(H, M, D), torch.zeros(H, M)
    plain, mass = mixed_attention(q, k_loc, v_loc, k_mem, v_mem, bias, 0.3)
    none = (torch.full((H, G, Tq), -math.inf), torch.randn(H, G, Tq, D))
    same, same_mass = mixed_attention(q, k_loc, v_loc, k_mem, v_mem, bias, 0.3, near=none)
    assert torch.allclose(plain, same, atol=1e-6) and torch.allclose(mass, same_mass)
    # a finite entry takes its share from every other entry
    some = (torch.zeros(H, G, Tq), torch.randn(H, G, Tq, D))
    _, less = mixed_attention(q, k_loc, v_loc, k_mem, v_mem, bias, 0.3, near=some)
    assert bool((less < mass).all())


def test_near_spans_change_the_answer_and_their_values_are_counted(tiny_loaded, tmp_path):
    """Near spans change the answer's logits; their values are the store's mean values of the
    head's own spans, and an attention call counts them in the answer's peak."""
    method, _ = sekv_method(tiny_loaded, tmp_path, STORE)
    tok = tiny_loaded.tokenizer
    q_ids = encode_question(tok, chat_template(tok), "Which room keeps item 12?")
    logits = {
        near: sekv_logits(method, q_ids, ZoomPolicy(ROUTERS["sketch"](), budget=24, near=near))
        for near in (0.0, 3.0)
    }
    assert not torch.allclose(logits[0.0], logits[3.0], atol=1e-4)
    spans = method.spans
    H, D, F = spans.num_kv_heads, spans.head_dim, spans.fixed_tokens
    index = torch.stack([torch.arange(5), torch.arange(5).flip(0) + 2])[:H]
    spans.clear()  # no pools: the call holds the fixed entries and the near values
    values = spans.span_values(1, index)
    means = spans._summaries["v"][1]
    for h in range(H):
        assert torch.equal(values[h].cpu(), means[h, index[h]].to(values.dtype))
    item = tiny_loaded.dtype.itemsize
    assert spans.peak_cached_bytes == H * (2 * F + 5) * D * item
    count = near_count(3.0, 24, spans.mean_span_length)
    assert spans.zoom_bytes(24, near_share=3.0) - spans.zoom_bytes(24) == H * count * D * item


def test_a_memory_target_pays_for_the_near_spans(tiny_loaded, tmp_path):
    """Under the same target, near spans take their values out of the zoom budget, and the
    answer's measured peak stays within the target."""
    budgets = {}
    for near in (0.0, 3.0):
        method, ctx = sekv_method(
            tiny_loaded, tmp_path, STORE, memory_ratio=0.5, budget=10**6, extra={"near": near}
        )
        tok = tiny_loaded.tokenizer
        list(method.generate(encode_question(tok, chat_template(tok), "Where is item 4?"), 4))
        budgets[near] = method.policy.budget
        assert method.policy.near == near
        kv = tiny_loaded.spec.kv_bytes(len(ctx), 2)
        assert method.memory()["resident_bytes"] <= 0.5 * kv
        assert method.routing()["near"] == near
    assert budgets[3.0] < budgets[0.0]
