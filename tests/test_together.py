"""Several documents read together in one softmax (sekv_core.together, the MemoryGroup path of
sekv_core.zoom.attention): one memory in a group is the single-memory path; two memories are
one softmax over both (checked against the model's own attention over both contexts, each at
its positions); the session-level answer with its sources by file."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from sekv_core.config import MethodSettings, SegmentSettings, StoreSettings
from sekv_core.decode import PositionedStep
from sekv_core.documents import load_document
from sekv_core.engine import AskOptions, Session
from sekv_core.methods import SeKV
from sekv_core.prompt import chat_template, encode_context, encode_question
from sekv_core.rope import Rope, rotate_half
from sekv_core.together import NotTogether, ask_together
from sekv_core.zoom.attention import GroupMember, MemoryGroup, ZoomPolicy, sekv_attention
from sekv_core.zoom.memory import SpanMemory
from sekv_core.zoom.router import SketchRouter

ROOMS = " ".join(
    f"Item {i} is kept in room {i * 7 % 31} of the {['north', 'east'][i % 2]} wing."
    for i in range(30)
)
KEEPERS = " ".join(
    f"The keeper of tower {i} is named {['Orla', 'Tomasz', 'Ines'][i % 3]} and works on day {i}."
    for i in range(20)
)
LOSSLESS = StoreSettings(
    key_code="*x16", value_code="*x16", segment=SegmentSettings(min_len=8, max_len=32)
)


def sekv_method(loaded, tmp_path, name, text, store=None, kv_bits=8):
    """A prepared SeKV over ``text`` (``kv_bits`` 16: token-level K/V in fp16, for exactness)."""
    path = tmp_path / name
    path.write_text(text)
    document = load_document(path)
    ctx = encode_context(loaded.tokenizer, chat_template(loaded.tokenizer), document.text)
    method = SeKV(loaded, document, ctx, MethodSettings(store=store or StoreSettings()))
    method.prepare()
    if kv_bits != 8:
        method.spans = SpanMemory(
            method.store, Rope(loaded.model), loaded.device, loaded.dtype, kv_bits
        )
    return method


def question(loaded, text="Which room keeps item 12?"):
    return encode_question(loaded.tokenizer, chat_template(loaded.tokenizer), text)


def decode_logits(loaded, start, q_ids, steps, **memory):
    """Next-token logits (steps + 1, vocab) of a greedy answer of ``steps`` tokens through the
    sekv attention, the question's first token at ``start``."""
    model = loaded.model
    out = []
    with sekv_attention(model):
        step = PositionedStep(model, DynamicCache(config=model.config), start, "cpu", **memory)
        logits = step(torch.tensor([q_ids]))
        for _ in range(steps):
            out.append(logits[0])
            logits = step(logits.argmax(-1, keepdim=True))
        out.append(logits[0])
    return torch.stack(out)


def test_a_group_of_one_is_the_single_memory_path(tiny_loaded, tmp_path):
    """The same logits at every step (question prefill, decoding), and a trace recording the
    same zoom, mass and answer attention."""
    method = sekv_method(tiny_loaded, tmp_path, "rooms.md", ROOMS)
    q_ids, start = question(tiny_loaded), len(method.context)
    single = method.begin_answer()
    want = decode_logits(tiny_loaded, start, q_ids, 4, sekv_memory=method.spans, sekv_policy=single)
    grouped = method.begin_answer()
    group = MemoryGroup((GroupMember(method.spans, grouped),))
    assert group.local_start == start
    got = decode_logits(tiny_loaded, start, q_ids, 4, sekv_group=group)
    assert torch.equal(got, want)
    a, b = single.trace, grouped.trace
    assert a.zoomed is not None and a.zoomed.any() and a.answer is not None
    for name in ("zoomed", "best_margin", "best_score", "tokens_max", "mass", "answer"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.calls == b.calls


def parallel_logits(model, contexts, shifts, q_ids, head):
    """The model's own logits (Tq, vocab) for ``q_ids`` after every context, read by hand:
    each context's full KV cache prefilled alone at its positions, the keys after the
    template's ``head`` turned on by its shift (RoPE undone at their positions, redone at the
    shifted ones), all caches joined into one; the question after the last context's end
    attends over all of it (the head of the first context only) and itself causally. One
    softmax per query over everything it sees."""
    config = model.config
    joint = DynamicCache(config=config)
    caches = []
    with torch.inference_mode():
        for c in contexts:
            caches.append(DynamicCache(config=config))
            model(input_ids=torch.tensor([c.ids]), cache=caches[-1], use_cache=True)
        for layer in range(config.num_hidden_layers):
            keys, values = [], []
            for c, cache, shift in zip(contexts, caches, shifts, strict=True):
                k = cache.layers[layer].keys.clone()  # (1, H, T, D) post-RoPE
                at = torch.arange(head, len(c))[None]
                cos, sin = model.model.rotary_emb(k, at)
                plain = k[..., head:, :] * cos - rotate_half(k[..., head:, :]) * sin
                cos, sin = model.model.rotary_emb(k, at + shift)
                k[..., head:, :] = plain * cos + rotate_half(plain) * sin
                keys.append(k)
                values.append(cache.layers[layer].values)
            joint.update(torch.cat(keys, dim=2), torch.cat(values, dim=2), layer)
        M, Tq = sum(len(c) for c in contexts), len(q_ids)
        sees = torch.ones(Tq, M + Tq, dtype=torch.bool)
        sees[:, len(contexts[0]) : len(contexts[0]) + head] = False  # the second's head
        sees[:, M:] = torch.ones(Tq, Tq, dtype=torch.bool).tril()
        mask = torch.zeros(Tq, M + Tq).masked_fill(~sees, float("-inf"))[None, None]
        start = max(len(c) + shift for c, shift in zip(contexts, shifts, strict=True))
        out = model(
            input_ids=torch.tensor([q_ids]),
            position_ids=torch.arange(Tq)[None] + start,
            cache=joint,
            attention_mask=mask,
        )
    return out.logits[0]


TOLERANCE = 2e-4  # logits through fp16 K/V vs the model's float32 attention


def everything():
    """A policy that zooms every span."""
    return ZoomPolicy(router=SketchRouter(), budget=10**6, margin=math.inf)


def test_two_memories_are_one_softmax_over_both(tiny_loaded, tmp_path):
    """Every span zoomed at full precision: the group's logits are the model's attention over
    both contexts at once (the first, shorter one shifted to end with the longer; the
    second's template head read from the first), which reading each memory alone does not
    give; each trace holds its own memory's attention."""
    keepers = sekv_method(tiny_loaded, tmp_path, "keepers.md", KEEPERS, LOSSLESS, kv_bits=16)
    rooms = sekv_method(tiny_loaded, tmp_path, "rooms.md", ROOMS, LOSSLESS, kv_bits=16)
    shift = len(rooms.context) - len(keepers.context)
    assert shift > 0
    q_ids = question(tiny_loaded, "Who keeps tower 4, and which room keeps item 12?")
    head = keepers.context.doc_start
    policies = [everything(), everything()]
    keepers.spans.clear()
    rooms.spans.clear()
    group = MemoryGroup(
        (
            GroupMember(keepers.spans, policies[0], head, shift=shift),
            GroupMember(rooms.spans, policies[1], head, read_head=False),
        )
    )
    start = group.local_start
    assert start == len(rooms.context)
    got = decode_logits(tiny_loaded, start, q_ids, 0, sekv_group=group)[0]
    contexts = [keepers.context, rooms.context]
    ref = parallel_logits(tiny_loaded.model, contexts, [shift, 0], q_ids, head)[-1]
    # K/V are stored in fp16 (the store's precision); logits agree to that tolerance
    assert torch.allclose(got, ref, atol=TOLERANCE, rtol=0), (got - ref).abs().max()
    unshifted = parallel_logits(tiny_loaded.model, contexts, [0, 0], q_ids, head)[-1]
    # the first context's positions did move: a reference without the shift is another answer
    assert (got - unshifted).abs().max() > 4 * (got - ref).abs().max()
    for method, policy in zip((keepers, rooms), policies, strict=True):
        assert policy.trace.zoomed_tokens_max == int(method.spans.lengths.sum())
        alone = decode_logits(
            tiny_loaded, start, q_ids, 0, sekv_memory=method.spans, sekv_policy=everything()
        )[0]
        assert (alone - ref).abs().max() > 20 * TOLERANCE  # one memory alone: another answer
    # the last query's attention, split back: the second memory's head took none, and each
    # memory's tokens took a share of the same softmax
    answer = [p.trace.answer for p in policies]
    assert answer[0] is not None and answer[1] is not None
    assert float(answer[1][..., :head].abs().max()) == 0
    assert float(answer[0][..., :head].max()) > 0
    assert float(answer[1][..., head:-1].max()) > 0


def session(loaded, tmp_path, name, text, method="sekv"):
    path = tmp_path / name
    path.write_text(text)
    return Session(loaded, load_document(path), method)


def test_one_session_together_answers_as_it_alone(tiny_loaded, tmp_path):
    s = session(tiny_loaded, tmp_path, "rooms.md", ROOMS)
    text = "Which room keeps item 12?"
    options = AskOptions(max_new_tokens=6)
    alone = s.answer(text, options)
    together = ask_together([s], text, options)
    assert together.answer == alone.answer and together.tokens_generated == alone.tokens_generated
    path = str(tmp_path / "rooms.md")
    assert together.sources == [dict(row, path=path) for row in alone.sources]
    assert together.zoom == [dict(row, path=path) for row in alone.zoom]
    assert together.memory == alone.memory
    assert together.routing == dict(alone.routing, read_together=[path])


def test_two_sessions_answer_with_both_documents(tiny_loaded, tmp_path):
    rooms = session(tiny_loaded, tmp_path, "rooms.md", ROOMS)
    keepers = session(tiny_loaded, tmp_path, "keepers.md", KEEPERS)
    told: list[str] = []
    answer = ask_together([rooms, keepers], "Who keeps tower 4?", AskOptions(6, told.append))
    paths = [str(tmp_path / "rooms.md"), str(tmp_path / "keepers.md")]
    assert "".join(told).strip() == answer.answer
    assert answer.routing["read_together"] == paths
    assert answer.document["path"] == paths[0]
    assert {z["path"] for z in answer.zoom} == set(paths)  # each document zoomed for it
    assert {s["path"] for s in answer.sources} <= set(paths)
    shares = [s["share"] for s in answer.sources]
    assert shares == sorted(shares, reverse=True) and sum(shares) <= 1
    each = [s.method.memory() for s in (rooms, keepers)]
    mem = answer.memory
    assert mem["resident_bytes"] == sum(m["resident_bytes"] for m in each)
    assert mem["offloaded_bytes"] == sum(m["offloaded_bytes"] for m in each)
    assert mem["local_window_bytes"] == each[0]["local_window_bytes"]
    assert mem["full_kv_bytes"] == sum(
        tiny_loaded.spec.kv_bytes(len(s.context), 2) for s in (rooms, keepers)
    )


def test_what_cannot_be_read_together_is_refused(tiny_loaded, tmp_path):
    rooms = session(tiny_loaded, tmp_path, "rooms.md", ROOMS)
    full = session(tiny_loaded, tmp_path, "keepers.md", KEEPERS, method="full")
    with pytest.raises(NotTogether, match="sessions: no document"):
        ask_together([], "Who?", AskOptions())
    with pytest.raises(NotTogether, match="given twice"):
        ask_together([rooms, rooms], "Who?", AskOptions())
    with pytest.raises(NotTogether, match="'keepers.md' is answered by 'full'"):
        ask_together([rooms, full], "Who?", AskOptions())
    book = session(tiny_loaded, tmp_path, "book.md", KEEPERS)
    book.method.spans.bounded = True  # as a book's store beyond the window is
    with pytest.raises(NotTogether, match="'book.md' is beyond the model's window"):
        ask_together([rooms, book], "Who?", AskOptions())


PORTER = (
    "The Harwick town archive keeps the records of the old harbour. Its night porter is "
    "called Ines Varga. She has guarded the reading room for twelve years and keeps the keys "
    "to the map cabinets. Visitors sign the blue register at her desk."
)
HOURS = (
    "The Harwick town archive closes at 9 pm on Fridays, so that students can read in the "
    "evening. Bags and coats are left in the lockers by the stairs. Only pencils are allowed "
    "near the maps. Photographs may be taken without flash."
)


@pytest.mark.integration
def test_an_answer_from_the_second_document_read_together(default_model, tmp_path):
    porter = session(default_model, tmp_path, "porter.md", PORTER)
    hours = session(default_model, tmp_path, "hours.md", HOURS)
    question = "At what time does the archive close on Fridays?"
    answer = ask_together([porter, hours], question, AskOptions(max_new_tokens=24))
    assert "9 pm" in answer.answer, answer.answer
    assert answer.sources and answer.sources[0]["path"] == str(tmp_path / "hours.md")
    assert "9 pm" in answer.sources[0]["text"]
    assert answer.routing["read_together"] == [str(tmp_path / n) for n in ("porter.md", "hours.md")]
