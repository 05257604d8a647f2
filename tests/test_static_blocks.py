"""Static semantic and block-retrieval baselines: memory accounting, exactness, Quest bound."""

import math

import torch
from safetensors.torch import load_file

from sekv_core.backend import use_attention
from sekv_core.config import BlockSettings, SegmentSettings, StoreSettings
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.methods import METHODS, MethodSettings, SeKV, static
from sekv_core.methods.blocks import (
    NAME,
    BlockPolicy,
    BlockRetrieval,
    QuestRouter,
    block_attention_forward,
)
from sekv_core.methods.full import FullKV
from sekv_core.methods.static import StaticSemantic, gather_spans, summarize
from sekv_core.prompt import chat_template, encode_context, encode_question

TEXT = " ".join(
    f"Item {i} is kept in room {i * 7 % 31} of the {['north', 'east'][i % 2]} wing."
    for i in range(20)
)
STORE = StoreSettings(segment=SegmentSettings(min_len=8, max_len=32))


def make(cls, loaded, tmp_path, **settings):
    path = tmp_path / "doc.md"
    path.write_text(TEXT)
    document = load_document(path)
    ctx = encode_context(loaded.tokenizer, chat_template(loaded.tokenizer), document.text)
    settings.setdefault("store", STORE)
    method = cls(loaded, document, ctx, MethodSettings(**settings))
    method.prepare()
    return method


def question(loaded, text="Which room keeps item 12?"):
    return encode_question(loaded.tokenizer, chat_template(loaded.tokenizer), text)


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


class Recording:
    """The Quest router, remembering each layer's queries."""

    name = "quest"

    def __init__(self):
        self.q = {}

    def scores(self, memory, layer, q, scaling):
        self.q[layer] = q.clone()
        return QuestRouter().scores(memory, layer, q, scaling)


def block_logits(method, q_ids, blocks, router=None):
    """Logits of every question position through the block attention."""
    model, memory = method.loaded.model, method.memory_store
    memory.clear()
    policy = BlockPolicy(router or QuestRouter(), blocks)
    pos = torch.arange(len(q_ids))[None] + len(method.context)
    with torch.inference_mode(), use_attention(model, NAME, block_attention_forward):
        out = model(
            input_ids=torch.tensor([q_ids]),
            position_ids=pos,
            block_memory=memory,
            block_policy=policy,
        )
    return out.logits[0]


# -- static semantic --------------------------------------------------------------------------


def test_static_never_reconstructs_and_counts_what_it_reads(tiny_loaded, tmp_path):
    method = make(StaticSemantic, tiny_loaded, tmp_path, memory_share=0.2)
    method.store._offload = None  # the summaries were read from it when prepared
    answer = list(method.generate(question(tiny_loaded), 6))
    assert len(answer) > 0
    spans = method.spans
    assert spans.reconstructions == 0
    assert method.store._offload is None  # answering never even maps the offload tier
    assert method.zoom_trace() == []
    mem = method.memory()
    fixed = [*spans.fixed[0].tensors(), *spans.fixed[1].tensors()]  # int8 rows + scales
    read = nbytes(*fixed, method.summary_k, method.summary_v)  # fp16 summaries
    assert mem["resident_bytes"] == read + 8 * spans.n_spans + 2 * spans.n_spans  # fp16 count
    assert mem["offloaded_bytes"] == 0
    assert mem["resident_bytes"] < spans.resident_bytes()  # the sketch is not counted
    assert method.routing()["reconstructions"] == 0


def test_summaries_are_the_weighted_key_at_the_mean_norm_and_the_mean_value():
    """From zero-padded span blocks (:func:`~sekv_core.methods.static.gather_spans`)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 300, 16, generator=g) + 0.5
    starts = torch.tensor([0, 20, 70, 71, 150, 230])
    ends = torch.tensor([20, 70, 71, 150, 230, 300])
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


def test_static_summaries_are_the_spans_weighted_mean_keys_and_mean_values(tiny_loaded, tmp_path):
    """Read from a lossless store's offload tier, the summaries are the surprisal-weighted mean
    key (rescaled to the mean key norm, rotated to the span's centre) and the mean value of each
    span's own tokens, as the full prefill gives them."""
    from sekv_core.prefill import prefill
    from sekv_core.rope import Rope

    lossless = StoreSettings(segment=STORE.segment, key_code="*x16", value_code="*x16")
    method = make(StaticSemantic, tiny_loaded, tmp_path, store=lossless)
    pre = prefill(tiny_loaded.model, method.context.ids, 512)
    starts, ends = method.spans.starts, method.spans.ends
    rope = Rope(tiny_loaded.model)
    keys = rope.unrotate(pre.keys.float(), torch.arange(len(method.context)))
    weights = gather_spans(torch.from_numpy(pre.surprisal)[:, None], starts, ends)[..., 0]
    blocks = [gather_spans(x, starts, ends) for x in (keys, pre.values.float())]
    want_k, want_v = summarize(*blocks, weights, ends - starts)
    want_k = rope.rotate(want_k, (starts + ends - 1) // 2)
    assert torch.allclose(method.summary_k.float(), want_k, atol=5e-3, rtol=1e-2)
    assert torch.allclose(method.summary_v.float(), want_v, atol=5e-3, rtol=1e-2)


def test_static_attends_summaries_with_log_len(tiny_loaded, tmp_path, monkeypatch):
    """Every attention call: one softmax over fixed + all summaries (+ log|S|) + local."""
    method = make(StaticSemantic, tiny_loaded, tmp_path)
    captured = {}
    real = static.mixed_attention

    def spy(q, k_local, v_local, k_mem, v_mem, bias, scaling, **options):
        captured.setdefault("first", (k_mem.shape[1], bias.clone()))
        return real(q, k_local, v_local, k_mem, v_mem, bias, scaling, **options)

    monkeypatch.setattr(static, "mixed_attention", spy)
    list(method.generate(question(tiny_loaded), 1))
    entries, bias = captured["first"]
    spans = method.spans
    F, N = spans.fixed_tokens, spans.n_spans
    assert entries == F + N  # no reconstructed token ever joins
    assert torch.equal(bias[:, :F], torch.zeros_like(bias[:, :F]))
    assert torch.allclose(bias[:, F:], spans.log_len[None].expand(bias.shape[0], N))


# -- block retrieval --------------------------------------------------------------------------


def test_blocks_covering_budget_equals_full_kv(tiny_loaded, tmp_path):
    method = make(BlockRetrieval, tiny_loaded, tmp_path)
    q_ids = question(tiny_loaded)
    memory = method.memory_store
    assert memory.n_blocks > 5 and memory.block_tokens % memory.block_size != 0  # partial last
    got = block_logits(method, q_ids, blocks=memory.n_blocks)
    ctx = method.context
    with torch.inference_mode():
        ref = tiny_loaded.model(input_ids=torch.tensor([ctx.ids + q_ids])).logits[0, len(ctx) :]
    assert torch.allclose(got, ref, atol=2e-3, rtol=0), (got - ref).abs().max()
    # and greedy answers agree with FullKV token for token
    full = FullKV(tiny_loaded, None, ctx, MethodSettings())
    full.prepare()
    method.settings.budget = memory.n_blocks * memory.block_size
    assert list(method.generate(q_ids, 8)) == list(full.generate(q_ids, 8))


def test_blocks_small_budget_loads_exactly_the_top_quest_blocks(tiny_loaded, tmp_path):
    method = make(BlockRetrieval, tiny_loaded, tmp_path)
    memory, k = method.memory_store, 3
    router = Recording()
    block_logits(method, question(tiny_loaded), blocks=k, router=router)
    kv = load_file(method.path / "blocks.safetensors")["kv"].float()
    L, H, B, S, D = (
        memory.num_layers,
        memory.num_kv_heads,
        memory.n_blocks,
        memory.block_size,
        memory.head_dim,
    )
    keys = kv.view(L, H, B, 2, S, D)[:, :, :, 0]  # (L, H, B, S, D) as stored
    valid = (torch.arange(B * S) < memory.block_tokens).view(B, S)
    scaling = D**-0.5
    for layer in range(L):
        q = router.q[layer].float()  # (H, G, Tq, D)
        lo = torch.where(valid[..., None], keys[layer], math.inf).amin(dim=2)  # (H, B, D)
        hi = torch.where(valid[..., None], keys[layer], -math.inf).amax(dim=2)
        # brute force: every query, every channel, the larger product
        prod = torch.maximum(
            q[:, :, :, None, :] * lo[:, None, None], q[:, :, :, None, :] * hi[:, None, None]
        )  # (H, G, Tq, B, D)
        bound = prod.sum(-1).amax(dim=(1, 2)) * scaling  # (H, B)
        want = bound.topk(k, dim=1).indices.sort(dim=1).values
        ids, loaded = memory.loaded[layer]
        assert torch.equal(ids.sort(dim=1).values, want)
        # the loaded K/V are exactly the stored blocks
        expect = kv.view(L, H, B, 2, S, D)[layer, torch.arange(H)[:, None], ids]
        assert torch.equal(loaded.float(), expect)
        # the bound holds for every real token's logit
        logits = torch.einsum("hgtd,hbsd->hgtbs", q, keys[layer]) * scaling
        best = logits.masked_fill(~valid, -math.inf).amax(dim=(1, 2, 4))  # (H, B)
        assert (best <= bound + 1e-4).all()
        routed = QuestRouter().scores(memory, layer, router.q[layer], scaling)
        assert torch.allclose(routed.float(), bound, atol=1e-3)


def test_blocks_memory_accounting(tiny_loaded, tmp_path):
    method = make(BlockRetrieval, tiny_loaded, tmp_path, memory_share=0.5)
    memory, spec = method.memory_store, tiny_loaded.spec
    L, H, B, S, D = (
        memory.num_layers,
        memory.num_kv_heads,
        memory.n_blocks,
        memory.block_size,
        memory.head_dim,
    )
    F = memory.sink_k.shape[2]
    n = len(method.context)
    assert F + memory.block_tokens == n
    reps = 2 * L * H * B * D * 2
    sinks = 2 * L * H * F * D * 2
    budget = int((0.5 * spec.kv_bytes(n, 2) - reps - sinks) // spec.kv_bytes(1, 2))
    assert method.budget() == budget
    list(method.generate(question(tiny_loaded), 4))
    k = budget // S
    mem = method.memory()
    loaded = L * H * k * S * 2 * D * 2  # every layer holds k blocks per head, fp16
    assert mem["offloaded_bytes"] == L * H * B * S * 2 * D * 2
    assert mem["representative_bytes"] == reps
    assert mem["resident_bytes"] == sinks + reps + loaded
    assert mem["resident_bytes"] <= 0.5 * spec.kv_bytes(n, 2)
    assert method.routing()["blocks_per_head"] == k
    # decoding mostly reuses loaded blocks: fewer reads than (5 steps x layers x heads x k)
    assert L * H * k <= method.routing()["blocks_read"] < 5 * L * H * k


def test_block_store_is_reused_and_a_corrupt_one_rebuilt(tiny_loaded, tmp_path):
    first = make(BlockRetrieval, tiny_loaded, tmp_path)
    assert not first.store_info()["cache_hit"]
    again = make(BlockRetrieval, tiny_loaded, tmp_path)
    assert again.store_info()["cache_hit"] and again.path == first.path
    (first.path / "blocks.safetensors").write_bytes(b"\0" * 64)
    warnings = []
    fixed = make(BlockRetrieval, tiny_loaded, tmp_path, warn=warnings.append)
    assert not fixed.store_info()["cache_hit"] and "truncated" in warnings[0]
    other = make(BlockRetrieval, tiny_loaded, tmp_path, blocks=BlockSettings(8))
    assert other.path != first.path and other.memory_store.block_size == 8


def test_both_run_end_to_end_through_a_session(tiny_loaded, tmp_path, monkeypatch):
    monkeypatch.setitem(METHODS, StaticSemantic.name, StaticSemantic)
    monkeypatch.setitem(METHODS, BlockRetrieval.name, BlockRetrieval)
    path = tmp_path / "doc.md"
    path.write_text(TEXT)
    document = load_document(path)
    settings = MethodSettings(memory_share=0.3, store=STORE)
    for name in ("static", "blocks"):
        session = Session(tiny_loaded, document, name, settings)
        answer = session.ask("Where is item 4 kept?", max_new_tokens=5)
        assert answer.method == name and answer.tokens_generated > 0
        assert answer.memory["resident_bytes"] > 0 and answer.store["path"]
        assert answer.routing and isinstance(answer.to_json()["zoom"], list)
        assert answer.memory["resident_bytes"] < answer.memory["full_kv_bytes"]
        assert answer.memory["resident_share"] < 1
    sekv = Session(tiny_loaded, document, SeKV.name, settings)  # static shares SeKV's store
    assert sekv.method.store_info()["cache_hit"]
