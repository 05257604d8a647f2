"""Routing diagnostics (sekv_bench.diagnostics): the oracle router, exact span shares, the probe."""

from __future__ import annotations

import pytest
import torch

from sekv_bench.diagnostics import (
    MarginRouter,
    OracleRouter,
    RoutingProbe,
    SpanKeys,
    ask_probed,
    attach_probe,
    exact_span_share,
)
from sekv_core.config import MethodSettings, SegmentSettings, StoreSettings
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.methods import SeKV
from sekv_core.prompt import chat_template, encode_context, encode_question
from sekv_core.zoom.attention import ZoomPolicy, sekv_attention
from sekv_core.zoom.router import select

TEXT = " ".join(
    f"Item {i} is kept in room {i * 7 % 31} of the {['north', 'east'][i % 2]} wing."
    for i in range(45)
)
LOSSLESS = StoreSettings(
    key_code="*x16", value_code="*x16", segment=SegmentSettings(min_len=8, max_len=32)
)
QUESTION = "Where is item 4?"


def document(tmp_path):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "doc.md"
    path.write_text(TEXT)
    return load_document(path)


def sekv_method(loaded, tmp_path, **settings) -> SeKV:
    doc = document(tmp_path)
    ctx = encode_context(loaded.tokenizer, chat_template(loaded.tokenizer), doc.text)
    method = SeKV(loaded, doc, ctx, MethodSettings(store=LOSSLESS, **settings))
    method.prepare()
    return method


def question_ids(loaded) -> list[int]:
    return encode_question(loaded.tokenizer, chat_template(loaded.tokenizer), QUESTION)


def route_question(method: SeKV, policy: ZoomPolicy) -> None:
    """Run the question's positions through the sekv attention under ``policy``."""
    model, q_ids = method.loaded.model, question_ids(method.loaded)
    method.spans.clear()
    pos = torch.arange(len(q_ids))[None] + len(method.context)
    with torch.inference_mode(), sekv_attention(model):
        model(
            input_ids=torch.tensor([q_ids]),
            position_ids=pos,
            sekv_memory=method.spans,
            sekv_policy=policy,
        )


@pytest.mark.parametrize("neighbours", [0, 1])
def test_a_winning_span_brings_its_neighbours(tiny_loaded, tmp_path, neighbours):
    """Margin 0: each (layer, head) zooms only its best span, with ``neighbours`` on each side."""
    method = sekv_method(tiny_loaded, tmp_path)
    policy = ZoomPolicy(router=OracleRouter(), budget=400, margin=0.0, neighbours=neighbours)
    route_question(method, policy)
    zoomed = policy.trace.zoomed  # (L, H, N): one routing per layer
    N = zoomed.shape[2]
    for row in zoomed.flatten(0, 1):
        picked = torch.nonzero(row)[:, 0]
        first, last = int(picked[0]), int(picked[-1])
        assert picked.tolist() == list(range(first, last + 1))  # one run of spans
        if neighbours == 0:
            assert len(picked) == 1
        else:  # the best span and one on each side, cut at the document's ends
            assert len(picked) == 3 or (len(picked) == 2 and (first == 0 or last == N - 1))


def test_oracle_recall_is_measured(tiny_loaded, tmp_path):
    doc = document(tmp_path)
    session = Session(tiny_loaded, doc, "sekv", MethodSettings(budget=40, store=LOSSLESS))
    probe = attach_probe(session)
    assert isinstance(probe, RoutingProbe) and session.method.observer is probe
    answer = ask_probed(session, QUESTION, 3, probe)
    routing = answer.routing
    assert 0.0 <= routing["recall_vs_oracle"] <= 1.0
    assert routing["router"] == "training-free"  # the answer's own summary is kept beside
    # the exact span attention the picks held: a share, the oracle's picks beside it
    held = routing["mass_captured"], routing["oracle_mass_captured"]
    assert all(0.0 < x <= 1.0 + 1e-5 for x in held), held
    # a second answer starts over: the same question gives the same figures
    assert ask_probed(session, QUESTION, 3, probe).routing == routing
    # the oracle against itself is perfect
    method = sekv_method(tiny_loaded, tmp_path)
    oracle_probe = RoutingProbe()
    oracle = ZoomPolicy(router=OracleRouter(), budget=40, observer=oracle_probe)
    route_question(method, oracle)
    assert oracle_probe.report()["recall_vs_oracle"] == 1.0
    # with every span zoomed, all of the span attention is held
    everything = Session(tiny_loaded, doc, "sekv", MethodSettings(budget=10**6, store=LOSSLESS))
    probe = attach_probe(everything)
    held = ask_probed(everything, QUESTION, 3, probe).routing["mass_captured"]
    assert held == pytest.approx(1.0, abs=1e-4)
    # methods without span routing have nothing to observe
    full = Session(tiny_loaded, doc, "full")
    assert attach_probe(full) is None
    assert "recall_vs_oracle" not in ask_probed(full, QUESTION, 3, None).routing


def test_exact_span_share_is_the_softmax_over_span_tokens_summed_per_span(tiny_loaded, tmp_path):
    memory = sekv_method(tiny_loaded, tmp_path).spans
    H, D = memory.num_kv_heads, memory.head_dim
    torch.manual_seed(0)
    q = torch.randn(H, 2, 3, D)
    keys = SpanKeys()
    share = exact_span_share(memory, 1, q, D**-0.5, keys)
    every = keys(memory, 1)
    for h in range(H):
        probs = (q[h] @ every[h].T * D**-0.5).softmax(-1).mean(dim=(0, 1))  # (S,)
        for n in (0, memory.n_spans // 2, memory.n_spans - 1):
            expected = probs[memory.sketch_span == n].sum()
            assert share[h, n] == pytest.approx(float(expected), abs=1e-5)
    assert torch.allclose(share.sum(1), torch.ones(H), atol=1e-5)


def test_span_keys_are_every_span_reconstructed_once_per_memory(tiny_loaded, tmp_path):
    memory = sekv_method(tiny_loaded, tmp_path).spans
    keys = SpanKeys()
    every = keys(memory, 0)  # (H, S, D)
    assert every.shape == (memory.num_kv_heads, int(memory.lengths.sum()), memory.head_dim)
    assert keys(memory, 0) is every  # cached per layer
    for h in range(memory.num_kv_heads):
        for n in (0, memory.n_spans - 1):
            span_keys, _ = memory.reconstruct(0, torch.tensor([n]), torch.tensor([h]))
            assert torch.equal(every[h, memory.sketch_span == n], span_keys)
    subset = memory.subset(0, torch.tensor([1, 3]))
    assert torch.equal(keys(subset, 0), every[:, subset.rows])
    other = sekv_method(tiny_loaded, tmp_path / "other").spans  # another memory: rebuilt
    assert keys(other, 0) is not every and keys.memory is other


def test_the_oracle_of_a_gate_router_keeps_the_margin_rule():
    """A trained router's policy has no margin: the probe's oracle then decides by the margin
    shifted to 0 (MarginRouter), which picks what the oracle under that margin picks."""
    torch.manual_seed(0)
    H, N = 2, 9
    scores = torch.randn(H, N) * 3
    lengths = torch.randint(2, 6, (N,))

    class Fixed:
        name = "fixed"

        def scores(self, memory, layer, q, scaling):
            return scores

    shifted = MarginRouter(Fixed(), 2.0).scores(None, 0, None, 1.0)
    assert torch.allclose(shifted.amax(dim=1), torch.full((H,), 2.0))
    by_gate, _ = select(shifted, lengths, 12, None)
    by_margin, _ = select(scores, lengths, 12, 2.0)
    assert torch.equal(by_gate, by_margin)


def test_the_probe_holds_a_gate_policy_to_the_margin_oracle(tiny_loaded, tmp_path):
    memory = sekv_method(tiny_loaded, tmp_path).spans
    H, D, N = memory.num_kv_heads, memory.head_dim, memory.n_spans
    torch.manual_seed(1)
    q = torch.randn(H, 2, 3, D)
    zoom = torch.rand(H, N) > 0.5
    reports = []
    for policy_margin in (None, 3.0):
        probe = RoutingProbe(margin=3.0)
        policy = ZoomPolicy(router=OracleRouter(), budget=30, margin=policy_margin)
        probe(policy, memory, 1, q, D**-0.5, zoom)
        reports.append(probe.report())
    assert reports[0] == reports[1] and set(reports[0]) == {
        "recall_vs_oracle",
        "mass_captured",
        "oracle_mass_captured",
    }
    assert RoutingProbe().report() == {}  # no decision seen
