"""Token-eviction baselines (StreamingLLM, H2O, SnapKV, ChunkKV) on tiny random models."""

import pytest
import torch

from sekv_core import engine
from sekv_core.documents import load_document
from sekv_core.engine import Session
from sekv_core.methods import FullKV, MethodSettings
from sekv_core.methods.chunkkv import ChunkKV
from sekv_core.methods.eviction import (
    AttentionStats,
    EvictionMethod,
    prefill_with_mass,
    window_mass,
)
from sekv_core.methods.full import truncate
from sekv_core.methods.h2o import H2O
from sekv_core.methods.shared_prefill import PrefillSlot
from sekv_core.methods.snapkv import SnapKV
from sekv_core.methods.streaming import StreamingLLM
from sekv_core.prompt import chat_template, encode_context, encode_question

DOC = " ".join(f"Item {i} is stored in room {i * 7 % 31}." for i in range(24))
QUESTIONS = ("Where is item 3?", "Which room holds item 12?")
BASELINES = [StreamingLLM, H2O, SnapKV, ChunkKV]
CHUNK = 64  # several prefill chunks


def setup(loaded, cls, **settings):
    tok = loaded.tokenizer
    tpl = chat_template(tok)
    ctx = encode_context(tok, tpl, DOC)
    method = cls(loaded, None, ctx, MethodSettings(prefill_chunk=CHUNK, **settings))
    method.prepare()
    return method, [encode_question(tok, tpl, q) for q in QUESTIONS]


def eager_attention(model, ids: list[int]) -> list[torch.Tensor]:
    """Per-layer (Hq, T, T) attention probabilities of one uncached eager forward."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    return [a[0].float() for a in out.attentions]


def per_kv_head(probs: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(Hq, Tq, T) probabilities -> (H_kv, T) mass per key, summed over queries and groups."""
    return probs.sum(dim=1).view(kv_heads, -1, probs.shape[-1]).sum(dim=1)


@pytest.mark.parametrize("cls", BASELINES, ids=lambda c: c.name)
def test_cache_holds_exactly_the_kept_tokens(tiny_loaded, cls):
    method, questions = setup(tiny_loaded, cls, memory_share=0.3)
    list(method.generate(questions[0], 4))  # question-aware methods compress per question
    spec, T = tiny_loaded.spec, len(method.context)
    k = round(0.3 * T)
    assert method.kept_tokens == k and method.routing() == {"kept_tokens": k, "policy": cls.name}
    keep = method.kept
    assert keep.shape == (spec.num_layers, spec.num_kv_heads, k)
    assert (keep.diff(dim=-1) > 0).all() and keep.min() >= 0 and keep.max() < T  # sorted, unique
    full = prefill_with_mass(tiny_loaded, method.context.ids, CHUNK)
    for src, kept, idx in zip(full.cache.layers, method.cache.layers, keep, strict=True):
        assert kept.keys.shape[-2] == k  # cropped back after the answer
        assert torch.equal(kept.keys[0], src.keys[0, torch.arange(spec.num_kv_heads)[:, None], idx])
        assert torch.equal(kept.values[0], src.values[0, torch.arange(len(idx))[:, None], idx])
    memory = method.memory()
    held = sum(x.keys.nbytes + x.values.nbytes for x in method.cache.layers)
    assert held == spec.kv_bytes(k, tiny_loaded.dtype.itemsize)
    assert memory["resident_bytes"] == spec.kv_bytes(k, 2)  # counted in fp16
    assert memory["offloaded_bytes"] == 0


def test_streaming_keeps_sinks_and_recent_window(tiny_loaded):
    sinks = setup(tiny_loaded, StreamingLLM, budget=2)[0].kept_tokens  # never below the sinks
    method, _ = setup(tiny_loaded, StreamingLLM, budget=sinks + 30)
    T = len(method.context)
    assert sinks == method.context.doc_start + 4 and method.kept_tokens == sinks + 30
    expected = list(range(sinks)) + list(range(T - 30, T))
    assert (method.kept == torch.tensor(expected)).all()
    assert setup(tiny_loaded, StreamingLLM)[0].kept_tokens == round(0.2 * T)


def test_captured_attention_matches_eager_and_h2o_keeps_heavy_hitters(tiny_loaded):
    method, questions = setup(tiny_loaded, H2O, memory_share=0.3)
    model, spec, ids = tiny_loaded.model, tiny_loaded.spec, method.context.ids
    full = prefill_with_mass(tiny_loaded, ids, CHUNK)
    T = len(ids)
    ref = torch.stack([per_kv_head(p, spec.num_kv_heads) for p in eager_attention(model, ids)])
    assert torch.allclose(full.mass, ref, rtol=1e-4, atol=1e-4)  # (L, H_kv, T)

    # H2O: the k/2 most recent tokens + the k/2 earlier tokens with the largest mass
    recent = method.kept_tokens // 2
    keep = method.kept
    assert (keep[..., -recent:] == torch.arange(T - recent, T)).all()
    older = ref[..., : T - recent]
    chosen = torch.zeros_like(older, dtype=torch.bool).scatter_(-1, keep[..., :-recent], True)
    weakest_kept = older.masked_fill(~chosen, float("inf")).amin(dim=-1)
    strongest_dropped = older.masked_fill(chosen, float("-inf")).amax(dim=-1)
    assert (weakest_kept >= strongest_dropped - 1e-4).all()

    # the question's attention onto the context (what SnapKV / ChunkKV score with)
    q = questions[0]
    window = window_mass(tiny_loaded, full, q)
    assert full.cache.get_seq_length() == T  # the question was cropped off again
    probs = eager_attention(model, ids + q)
    ref_window = torch.stack([per_kv_head(p[:, T:, :T], spec.num_kv_heads) for p in probs])
    assert torch.allclose(window, ref_window, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", BASELINES, ids=lambda c: c.name)
def test_keeping_everything_reproduces_full_kv(tiny_loaded, cls):
    method, questions = setup(tiny_loaded, cls, memory_share=1.0)
    full = FullKV(tiny_loaded, None, method.context, MethodSettings(prefill_chunk=CHUNK))
    full.prepare()
    for q in questions:
        ours = list(method.generate(q, 10))
        assert ours == list(full.generate(q, 10)) and ours
    assert (method.kept == torch.arange(len(method.context))).all()
    T, q = len(method.context), questions[1]
    truncate(full.cache, T)
    with torch.inference_mode():
        pos = torch.arange(T, T + len(q))[None]
        ids = torch.tensor([q])
        a = tiny_loaded.model(input_ids=ids, position_ids=pos, cache=method.cache).logits
        b = tiny_loaded.model(input_ids=ids, position_ids=pos, cache=full.cache).logits
    truncate(method.cache, T)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


class RandomKeep(EvictionMethod):
    """Test policy: a random subset per KV head (the same in every layer)."""

    name = "random"

    def keep(self, stats: AttentionStats) -> torch.Tensor:
        spec, T = self.loaded.spec, len(self.context)
        g = torch.Generator().manual_seed(1)
        k = self.kept_tokens
        rows = [torch.randperm(T, generator=g)[:k] for _ in range(spec.num_kv_heads)]
        return torch.stack(rows).sort(dim=-1).values.expand(spec.num_layers, -1, -1)


def test_compressed_cache_equals_full_cache_with_evicted_entries_masked(tiny_loaded):
    """Fewer cache entries, positions after the context: same as masking the evicted ones."""
    method, questions = setup(tiny_loaded, RandomKeep, budget=70)
    model, spec, T, q = tiny_loaded.model, tiny_loaded.spec, len(method.context), questions[0]
    n = len(q)
    pos, ids = torch.arange(T, T + n)[None], torch.tensor([q])
    with torch.inference_mode():
        ours = model(input_ids=ids, position_ids=pos, cache=method.cache).logits
    truncate(method.cache, method.kept_tokens)

    full = FullKV(tiny_loaded, None, method.context, MethodSettings(prefill_chunk=CHUNK))
    full.prepare()
    visible = torch.zeros(spec.num_kv_heads, n, T + n, dtype=torch.bool)
    visible[torch.arange(spec.num_kv_heads)[:, None], :, method.kept[0]] = True
    visible[:, :, T:] = torch.ones(n, n, dtype=torch.bool).tril()
    visible = visible.repeat_interleave(spec.num_heads // spec.num_kv_heads, dim=0)
    mask = torch.zeros(1, spec.num_heads, n, T + n).masked_fill(
        ~visible[None], torch.finfo(torch.float32).min
    )
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            ref = model(input_ids=ids, position_ids=pos, cache=full.cache, attention_mask=mask)
    finally:
        model.set_attn_implementation(previous)
    assert torch.allclose(ours, ref.logits, atol=1e-4, rtol=1e-4)
    # and dropping tokens does change the answer's logits (the test can fail)
    with torch.inference_mode():
        truncate(full.cache, T)
        plain = model(input_ids=ids, position_ids=pos, cache=full.cache).logits
    assert not torch.allclose(ours, plain, atol=1e-3)


@pytest.mark.parametrize("cls", BASELINES, ids=lambda c: c.name)
def test_session_end_to_end_and_repeated_questions(tiny_loaded, cls, tmp_path, monkeypatch):
    monkeypatch.setitem(engine.METHODS, cls.name, cls)
    path = tmp_path / "items.md"
    path.write_text(DOC)
    session = Session(tiny_loaded, load_document(path), cls.name, MethodSettings(memory_share=0.25))
    first = session.ask(QUESTIONS[0], max_new_tokens=8)
    session.ask(QUESTIONS[1], max_new_tokens=8)
    again = session.ask(QUESTIONS[0], max_new_tokens=8)
    assert first.method == cls.name and first.tokens_generated > 0
    assert again.answer == first.answer and again.tokens_generated == first.tokens_generated
    k = round(0.25 * len(session.context))
    assert first.routing == {"kept_tokens": k, "policy": cls.name}
    assert first.memory["resident_bytes"] == tiny_loaded.spec.kv_bytes(k, 2)


def test_one_prefill_per_document_for_sessions_sharing_a_slot(tiny_loaded):
    """Methods handed one PrefillSlot prefill a context once; without one each prefills on its
    own, and nothing is kept between them (no module state)."""
    tok = tiny_loaded.tokenizer
    tpl = chat_template(tok)
    ctx = encode_context(tok, tpl, DOC)
    T = len(ctx)

    slot = PrefillSlot()
    calls = Calls()
    for cls, ratio in ((StreamingLLM, 0.1), (H2O, 0.2), (SnapKV, 0.5)):
        settings = MethodSettings(memory_share=ratio, prefill_chunk=CHUNK)
        cls(tiny_loaded, None, ctx, settings, slot).prepare(calls)
    assert calls.done == [*range(CHUNK, T, CHUNK), T, T, T]  # chunked once, then reused twice
    first = slot.full
    other = encode_context(tok, tpl, DOC[: len(DOC) // 2])
    H2O(tiny_loaded, None, other, MethodSettings(prefill_chunk=CHUNK), slot).prepare()
    assert slot.full is not first and slot.full.length == len(other)  # the slot holds one
    alone = Calls()
    for cls in (StreamingLLM, H2O):
        cls(tiny_loaded, None, ctx, MethodSettings(prefill_chunk=CHUNK)).prepare(alone)
    assert alone.done == [*range(CHUNK, T, CHUNK), T] * 2  # no slot: each prefills
    assert slot.full.length == len(other)  # untouched by sessions without it


class Calls:
    """A progress callback recording ``done`` of each call."""

    def __init__(self) -> None:
        self.done: list[int] = []

    def __call__(self, done: int, total: int) -> None:
        self.done.append(done)
