"""Streamed ingest: one-shot consistency, bounded positions for books, resume, flat memory, pages.

A tiny random Llama with a 512-token window stands for the default model: its "books" are a few
windows long, so every path of the streamed builder runs in seconds.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny_model
from safetensors.torch import load_file

import sekv_core.store.stream as stream_mod
from sekv_core.config import BOOK_WINDOW, SegmentSettings, StoreSettings, StreamSettings
from sekv_core.documents import Document, token_pages
from sekv_core.engine import Session
from sekv_core.errors import SekvError
from sekv_core.ingest import open_or_build
from sekv_core.methods import MethodSettings, SeKV
from sekv_core.models import load_model
from sekv_core.passages import FUSION_K, NEUTRAL_QUESTION
from sekv_core.prompt import chat_template, encode_context, encode_question
from sekv_core.segment import ANCHOR, SINK, SPAN
from sekv_core.sketch import dequantize_sketch
from sekv_core.store import shelf
from sekv_core.store.codes import load_code
from sekv_core.store.entropy import usable as entropy_coded
from sekv_core.store.format import FILES
from sekv_core.store.partial import PartialStore
from sekv_core.store.resident import CODEBOOKS
from sekv_core.zoom.attention import ZoomPolicy, sekv_attention
from sekv_core.zoom.router import SketchRouter

WINDOW = 512
SEGMENT = SegmentSettings(min_len=8, max_len=32)
BOOK = StoreSettings(
    prefill_chunk=64,
    segment=SEGMENT,
    stream=StreamSettings(window=96, budget=48, route_queries=8),
)
WORDS = ["north", "south", "old", "new", "red", "blue"]


def text_of(sections: int, offset: int = 0) -> str:
    return "\n\n".join(
        f"Section {i}. The {WORDS[i % 6]} vault on floor {i % 9} holds crate {i * 37 % 101}."
        for i in range(offset, offset + sections)
    )


def document(tmp_path: Path, text: str, pages: int = 1, name: str = "book.md") -> Document:
    """A document whose ``pages`` pages each hold an equal share of the paragraphs."""
    path = tmp_path / name
    path.write_text(text)
    starts = [0] + [m + 2 for m in _paragraph_breaks(text)]
    per_page = math.ceil(len(starts) / pages)
    page_starts = tuple(starts[::per_page])
    digest = hashlib.sha256(text.encode()).hexdigest()
    return Document(path, digest, text, page_starts, "pdf" if pages > 1 else "md")


def _paragraph_breaks(text: str) -> list[int]:
    out, i = [], text.find("\n\n")
    while i >= 0:
        out.append(i)
        i = text.find("\n\n", i + 2)
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and lose much on a shared, busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A tiny Llama with a 512-token window."""
    path = build_tiny_model(tmp_path_factory.mktemp("small-window") / "llama", "llama", WINDOW)
    return load_model(str(path), device="cpu")


def context_of(loaded, doc):
    return encode_context(loaded.tokenizer, chat_template(loaded.tokenizer), doc.text)


def test_stream_within_the_window_matches_one_shot(small, tmp_path):
    """A window covering the document: same segmentation, same tensors up to fp16 rounding.

    May differ: the summed attention order (the streamed chunks attend through sekv's softmax,
    the one-shot prefill through the model's own), so surprisal agrees to ~1e-5 and a sketch
    entry can round to the neighbouring 4-bit level. Must match: roles, spans, pages, ids.
    """
    doc = document(tmp_path, text_of(6))
    ctx = context_of(small, doc)
    assert len(ctx) + 32 < WINDOW
    wide = StoreSettings(
        prefill_chunk=64, segment=SEGMENT, stream=StreamSettings(window=1024, always=True)
    )
    one, _ = open_or_build(small, doc, ctx, StoreSettings(prefill_chunk=64, segment=SEGMENT))
    streamed, _ = open_or_build(small, doc, ctx, wide)
    assert streamed.manifest["positions"]["mode"] == "original"
    assert "stream" in streamed.manifest and "stream" not in one.manifest
    for name in ("token_ids", "roles", "pages", "offsets"):
        assert torch.equal(one.trace[name], streamed.trace[name]), name
    assert torch.allclose(one.trace["surprisal"], streamed.trace["surprisal"], atol=1e-4)
    for name, tensor in one.resident.tensors().items():
        other = streamed.resident.tensors()[name]
        assert other.shape == tensor.shape and other.dtype == tensor.dtype, name
        if name.startswith("sketch") or name in CODEBOOKS:
            continue  # signs of principal directions: compared below
        if tensor.dtype == torch.int8:  # 8-bit rows: a code on a rounding edge may differ by 1
            assert (tensor.long() - other.long()).abs().max() <= 1, name
            continue
        assert torch.allclose(tensor.float(), other.float(), atol=2e-3), name
    proj_a, proj_b = one.resident.sketch_proj.float(), streamed.resident.sketch_proj.float()
    sign = (proj_a * proj_b).sum(dim=2).sign()  # (L, H, R): +1 or -1 per direction
    assert torch.allclose(proj_a, proj_b * sign[:, :, None], atol=2e-3)
    R = proj_a.shape[-1]
    levels_a = dequantize_sketch(one.resident.sketch, R, torch.float32)
    levels_b = dequantize_sketch(streamed.resident.sketch, R, torch.float32)
    flips = (levels_a != levels_b * sign[:, :, None]).float().mean()
    assert flips < 0.01  # a value on a rounding edge may take the neighbouring level
    # the offload tier: the same rows (codebooks fitted on the same span tokens; a direction's
    # sign may flip, and a coefficient on a rounding edge may take the neighbouring level)
    a, b = one.tier.whole(), streamed.tier.whole()  # the records (decoded from the files)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    for kind, name in (("k", "key"), ("v", "value")):
        spec = one.manifest["settings"][f"{name}_code"]
        x, y = decoded(one, a, kind, spec), decoded(streamed, b, kind, spec)
        assert (x - y).norm() / x.norm() < 1e-2, kind


def decoded(store, flat: dict, kind: str, spec: str) -> torch.Tensor:
    """Every span token's rows (L, H, S, D) of ``kind`` as the store's code decodes them."""
    code = load_code(store.resident.codebooks, kind, spec)
    L, H = store.resident.fixed_k.shape[:2]
    records = flat[f"{kind}_rows"].view(L, H, -1, code.record_bytes)
    heads = torch.arange(H).repeat_interleave(records.shape[2])
    layers = [code.decode(records[i].flatten(0, 1), i, heads, torch.float32) for i in range(L)]
    return torch.stack(layers).view(L, H, records.shape[2], -1)


def test_stream_with_a_short_window_keeps_the_partition_and_first_tokens(small, tmp_path):
    """A window shorter than the document: later tokens see the older ones only through the
    store (zoomed spans), and the segmentation threshold is estimated online, so boundaries and
    later surprisal may differ. Every token still has exactly one role, spans tile the span
    tokens, and the tokens read before anything left the window are exact."""
    doc = document(tmp_path, text_of(6))
    ctx = context_of(small, doc)
    short = StoreSettings(
        prefill_chunk=64, segment=SEGMENT, stream=StreamSettings(window=96, budget=48, always=True)
    )
    one, _ = open_or_build(small, doc, ctx, StoreSettings(prefill_chunk=64, segment=SEGMENT))
    streamed, _ = open_or_build(small, doc, ctx, short)
    assert streamed.manifest["stream"]["parts"] > 1
    roles = streamed.trace["roles"].numpy()
    starts, ends = streamed.resident.span_starts, streamed.resident.span_ends
    covered = np.zeros(len(ctx), dtype=int)
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        covered[s:e] += 1
    assert (covered == (roles == SPAN)).all()  # spans tile exactly the span tokens
    assert torch.equal(one.trace["roles"] == SINK, streamed.trace["roles"] == SINK)
    assert (ends <= len(ctx)).all() and (starts[1:] >= ends[:-1]).all()
    fixed = streamed.resident.fixed_pos.numpy()
    assert np.array_equal(fixed, np.flatnonzero(roles != SPAN))
    assert (roles == ANCHOR).sum() <= 0.05 * (len(ctx) - ctx.doc_start)
    assert torch.equal(one.trace["pages"], streamed.trace["pages"])
    exact = 96 + 64 + ctx.doc_start  # nothing had left the window before these tokens
    assert torch.allclose(
        one.trace["surprisal"][:exact], streamed.trace["surprisal"][:exact], atol=1e-4
    )


def test_everything_zoomed_answers_as_full_attention_within_the_window(small, tmp_path):
    """Streamed (window covering the document) and one-shot stores give the same logits as
    full attention when every span is zoomed at full rank: the answers cannot differ."""
    doc = document(tmp_path, text_of(5))
    ctx = context_of(small, doc)
    lossless = dict(key_code="*x16", value_code="*x16", segment=SEGMENT, prefill_chunk=64)
    tok = small.tokenizer
    q_ids = encode_question(tok, chat_template(tok), "Which crate is on floor 4?")
    with torch.inference_mode():
        ref = small.model(input_ids=torch.tensor([ctx.ids + q_ids])).logits[0, len(ctx) :]
    answers = []
    for always in (False, True):
        settings = StoreSettings(**lossless, stream=StreamSettings(window=1024, always=always))
        method = SeKV(small, doc, ctx, MethodSettings(store=settings))
        method.prepare()
        policy = ZoomPolicy(router=SketchRouter(), budget=10**6, margin=math.inf)
        method.spans.clear()
        with torch.inference_mode(), sekv_attention(small.model):
            got = small.model(
                input_ids=torch.tensor([q_ids]),
                position_ids=torch.arange(len(q_ids))[None] + len(ctx),
                sekv_memory=method.spans,
                sekv_policy=policy,
            ).logits[0]
        assert torch.allclose(got, ref, atol=2e-3, rtol=0), (got - ref).abs().max()
        method.settings.budget = 10**6
        method.settings.margin = math.inf
        answers.append(list(method.generate(q_ids, 8)))
    assert answers[0] == answers[1]


def record_positions(model) -> list[int]:
    """Every RoPE position the model's rotary embedding is asked for (the pipeline's own
    rotations use the same module)."""
    rotary, seen = model.model.rotary_emb, []
    forward = rotary.forward

    def spy(x, position_ids, *args, **kwargs):
        if position_ids.numel():
            seen.append(int(position_ids.max()))
        return forward(x, position_ids, *args, **kwargs)

    rotary.forward = spy
    return seen


def test_a_book_never_uses_positions_beyond_the_window(small, tmp_path):
    doc = document(tmp_path, text_of(40))
    ctx = context_of(small, doc)
    assert len(ctx) > 2 * WINDOW
    seen = record_positions(small.model)
    try:
        settings = MethodSettings(budget=64, store=BOOK)
        session = Session(small, doc, "sekv", settings)
        answer = session.ask("Which crate is on floor 4?", max_new_tokens=6)
    finally:
        del small.model.model.rotary_emb.forward
    store = session.method.store
    assert store.manifest["positions"] == {"mode": "bounded", "sinks": ctx.doc_start + 4}
    assert store.manifest["stream"]["max_position"] < WINDOW
    assert session.method.max_position < WINDOW
    assert seen and max(seen) < WINDOW, max(seen)
    assert answer.document["tokens"] == len(ctx) - ctx.doc_start
    assert answer.memory["resident_bytes"] < answer.memory["full_kv_bytes"]
    # full KV still refuses what does not fit, with the usual error
    with pytest.raises(SekvError, match="reads at most"):
        Session(small, doc, "full")


def build(loaded, doc, ctx, **kwargs):
    store, hit = open_or_build(loaded, doc, ctx, BOOK, **kwargs)
    return store


def store_tensors(store) -> dict[str, torch.Tensor]:
    out = {f"r.{k}": v.cpu() for k, v in load_file(store.path / "resident.safetensors").items()}
    out.update({f"t.{k}": v for k, v in load_file(store.path / "trace.safetensors").items()})
    out.update({f"o.{k}": v for k, v in load_file(store.path / "offload.safetensors").items()})
    return out


def test_interrupted_ingest_resumes_to_the_same_store(small, tmp_path, monkeypatch, sekv_home):
    monkeypatch.setattr(stream_mod, "CHECKPOINT_S", 0.0)  # a checkpoint after every chunk
    doc = document(tmp_path, text_of(24))
    ctx = context_of(small, doc)
    reference = store_tensors(build(small, doc, ctx))

    monkeypatch.setenv("SEKV_HOME", str(tmp_path / "other-home"))
    calls = []

    def stop_midway(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(small, doc, ctx, progress=stop_midway)
    stores = tmp_path / "other-home" / "stores"
    assert [p.name[:9] for p in stores.iterdir()] == [".partial-"]  # nothing that loads
    (interrupted,) = shelf.list_stores(stores)  # `sekv stores list` names its document
    assert interrupted.kind == "resumable" and interrupted.document == str(doc.path.absolute())
    warnings, resumed_at = [], []
    store = build(small, doc, ctx, progress=lambda d, t: resumed_at.append(d), warn=warnings.append)
    assert any("resuming" in w for w in warnings), warnings
    assert resumed_at[0] == calls[-1]  # continued from the last chunk done, not from 0
    assert [p.name for p in stores.iterdir()] == [store.path.name]
    again = store_tensors(store)
    assert again.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(again[name], tensor), name
    assert set(store.manifest["files"]) == set(FILES)


def test_a_damaged_checkpoint_restarts_cleanly(small, tmp_path, monkeypatch):
    monkeypatch.setattr(stream_mod, "CHECKPOINT_S", 0.0)
    doc = document(tmp_path, text_of(16))
    ctx = context_of(small, doc)

    def stop(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(small, doc, ctx, progress=stop)
    partial = next((tmp_path / "sekv-home" / "stores").glob(".partial-*"))
    part = sorted(partial.glob("part-*.safetensors"))[0]
    data = bytearray(part.read_bytes())
    data[-3] ^= 0xFF
    part.write_bytes(bytes(data))
    warnings, progress = [], []
    store = build(small, doc, ctx, warn=warnings.append, progress=lambda d, t: progress.append(d))
    assert any("restarting" in w for w in warnings), warnings
    assert progress[0] < len(ctx) // 2  # started again from the beginning
    assert store.manifest["stream"]["parts"] >= 2


def test_memory_held_while_streaming_does_not_grow_with_length(small, tmp_path):
    """Two books, one twice as long: the tensors held for attention (the tokens waiting in the
    window) peak at the same size; only the resident routing tier grows, by a small fixed
    share of the full KV cache per token."""
    reports = []
    for sections in (20, 40):
        doc = document(tmp_path, text_of(sections), name=f"book-{sections}.md")
        ctx = context_of(small, doc)
        store = build(small, doc, ctx)
        reports.append((len(ctx), store.manifest["stream"]))
    (short_t, short), (long_t, long) = reports
    assert long_t > 1.8 * short_t
    assert long["peak_window_bytes"] == short["peak_window_bytes"]
    window_bound = (96 + 2 * 64 + 32) * small.spec.kv_bytes(1, 4)  # window + 2 chunks + a span
    assert long["peak_window_bytes"] <= window_bound
    # the resident routing tier (4-bit sketch, per-span tables and bounds) grows per token by a
    # fixed share of the fp16 KV cache: ~20% for this head_dim-16 model, ~7% at head_dim 64
    growth = (long["memory_resident_bytes"] - short["memory_resident_bytes"]) / (long_t - short_t)
    assert 0 < growth < 0.25 * small.spec.kv_bytes(1, 2)


def test_page_citations_stay_right_across_chunks(small, tmp_path):
    doc = document(tmp_path, text_of(30), pages=10)
    ctx = context_of(small, doc)
    settings = MethodSettings(budget=48, store=BOOK, margin=math.inf)
    session = Session(small, doc, "sekv", settings)
    store = session.method.store
    expected = [1] * ctx.doc_start + token_pages(doc, ctx.offsets)
    assert store.trace["pages"].tolist() == expected
    assert store.manifest["stream"]["parts"] > 3  # many chunks and parts
    answer = session.ask("Which crate is on floor 4?", max_new_tokens=4)
    assert answer.zoom
    for z in answer.zoom:  # the page of each zoomed span is its first character's page
        first_char = int(store.trace["offsets"][z["start"]][0])
        assert z["page"] == doc.page_of_char(first_char)
    assert {z["page"] for z in answer.zoom} - {1}  # spans beyond the first page are cited


def test_beyond_the_reading_window_a_long_window_model_reads_a_book(tmp_path_factory, tmp_path):
    """A model whose window holds 2 * BOOK_WINDOW tokens: a document beyond BOOK_WINDOW is read
    as a book (bounded positions within BOOK_WINDOW, passages for the question), one within
    it as a document at its own positions; full KV reads either whole."""
    path = build_tiny_model(tmp_path_factory.mktemp("wide") / "llama", "llama", 2 * BOOK_WINDOW)
    wide = load_model(str(path), device="cpu")
    settings = MethodSettings(budget=64, store=StoreSettings(prefill_chunk=512, segment=SEGMENT))
    book = document(tmp_path, text_of(230), name="long.md")
    assert BOOK_WINDOW < len(context_of(wide, book)) < wide.spec.window // 2 + BOOK_WINDOW // 4
    session = Session(wide, book, "sekv", settings)
    answer = session.ask("Which crate is on floor 4?", max_new_tokens=4)
    store = session.method.store
    assert store.manifest["positions"]["mode"] == "bounded"
    assert store.manifest["stream"]["max_position"] < BOOK_WINDOW
    assert session.method.max_position < BOOK_WINDOW
    assert session.method.policy.pinned is not None  # the question's passages
    assert answer.answer is not None
    full = Session(wide, book, "full").ask("Which crate is on floor 4?", max_new_tokens=4)
    assert full.document["tokens"] == answer.document["tokens"]
    short = Session(wide, document(tmp_path, text_of(150), name="short.md"), "sekv", settings)
    assert BOOK_WINDOW // 2 < len(short.context) < BOOK_WINDOW
    assert short.method.store.manifest["positions"]["mode"] == "original"


def test_cli_ingests_and_answers_a_book_that_full_kv_refuses(small, tmp_path):
    import json

    from typer.testing import CliRunner

    from sekv_cli.main import app

    runner = CliRunner()
    book = tmp_path / "book.md"
    book.write_text(text_of(24))
    model = str(small.model.name_or_path)
    result = runner.invoke(app, ["ingest", str(book), "--model", model, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["positions"] == "bounded" and data["stream"]["max_position"] < WINDOW
    assert data["tokens"] > 2 * WINDOW
    result = runner.invoke(app, ["ask", str(book), "Which crate?", "--model", model, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["store"]["cache_hit"]  # the ingested store is reused
    result = runner.invoke(app, ["ask", str(book), "Which?", "--model", model, "--method", "full"])
    assert result.exit_code == 1 and "reads at most" in result.stderr


def test_a_book_keeps_no_anchors_and_answers_from_whole_sentence_passages(small, tmp_path):
    doc = document(tmp_path, text_of(40))
    settings = MethodSettings(store=BOOK, passages=96)
    session = Session(small, doc, "sekv", settings)
    store, method = session.method.store, session.method
    # boundary tokens stay in their spans: nothing is pinned at one position but the sinks
    assert store.manifest["stats"]["anchors"] == 0
    assert method.spans.fixed_tokens == store.manifest["positions"]["sinks"]
    answer = session.ask("Which crate is on floor 4?", max_new_tokens=4)
    policy = method.policy
    pinned, scores = policy.pinned.cpu(), policy.pinned_scores.cpu()
    # the question's most attended span is read, with its whole sentence, within the budget
    best = int(scores.argmax())
    assert scores[best] > 0 and pinned[best]
    sentences = method.span_sentences()
    assert pinned[sentences == sentences[best]].all()
    tokens = int(method.spans.lengths.cpu()[pinned].sum())
    assert 0 < tokens <= 96 and answer.routing["passages"] == {
        "spans": int(pinned.sum()),
        "tokens": tokens,
    }
    # every layer and KV head read the same passages, and nothing else
    zoomed = policy.trace.zoomed.cpu()
    assert (zoomed == pinned[None, None]).all()
    assert {z["span"] for z in answer.zoom} == set(pinned.nonzero()[:, 0].tolist())
    assert method.max_position < WINDOW
    # passage by passage before the question, the best passage last, each in document order
    pool, place = method.spans.pools[0], policy.placement.cpu()
    order = pool.document_order(policy.placement)[0].cpu()
    owner, token = pool.owner[0].cpu(), pool.token[0].cpu()
    read = order[: int(pool.active[0].sum())]  # the first at pool_end - n, the last pool_end - 1
    assert set(owner[read].tolist()) == set(pinned.nonzero()[:, 0].tolist())
    assert place[owner[read]].tolist() == sorted(place[owner[read]].tolist())
    best = place == place[pinned].max()
    assert scores[best].max() == scores[pinned].max() and bool(best[owner[read[-1]]])
    nearest = read[best[owner[read]]]
    assert token[nearest].tolist() == sorted(token[nearest].tolist())
    # the spans rank by the attention beyond the neutral question's, read once per session
    neutral = method.neutral[1]
    assert (scores >= 0).all() and neutral.shape == scores.shape and bool((neutral > 0).any())
    # the neutral question itself (nothing beyond itself) still reads its best passages
    again = session.ask(NEUTRAL_QUESTION, max_new_tokens=2)
    assert method.neutral[1] is neutral and again.routing["passages"]["spans"] > 0


def test_a_book_reads_the_sentence_that_shares_the_question_words(small, tmp_path):
    rare = "The zephyr quartz lies in the copper annex."
    paragraphs = text_of(40).split("\n\n")
    paragraphs.insert(23, rare)
    doc = document(tmp_path, "\n\n".join(paragraphs))
    session = Session(small, doc, "sekv", MethodSettings(store=BOOK, passages=192))
    method = session.method
    question = "Where does the zephyr quartz lie?"
    # the question's words pick the one sentence that holds them, through the store's spans
    words, covered = method.word_scores(question)
    assert covered > 0.5  # the sentence holds every word but the function words
    offsets = method.store.trace["offsets"]
    starts = offsets[method.spans.starts.long(), 0]
    at = doc.text.index(rare)
    inside = (starts >= at) & (starts < at + len(rare))
    assert inside.any() and (words[inside] == words.max()).all()
    assert words[~inside].max() < words.max()
    # a random model's attention knows nothing of them; the fused ranking still puts the
    # sentence first (beside the attention's own first) and reads it
    session.ask(question, max_new_tokens=2)
    scores = method.policy.pinned_scores.cpu()
    assert (scores[inside] >= 1 / (FUSION_K + 1) - 1e-7).all()
    assert method.policy.pinned.cpu()[inside].all()


def test_streamed_stores_route_with_the_sketch_of_their_decoded_keys(small, tmp_path, monkeypatch):
    """Streamed within the model's window (original positions) and beyond it (a book: pre-RoPE
    keys), several parts, rows requantised where a part widened the scale: the records are
    entropy-coded as a short document's; the sketch rows of the decoded keys (rebuilt at load
    within the window, stored for a book) are the streamed ones within a level."""
    finished = PartialStore.finished
    made = {}

    def keep(self, *args):
        made["sketch"] = self.resident.sketch.cpu().clone()  # what the chunks routed with
        return finished(self, *args)

    monkeypatch.setattr(PartialStore, "finished", keep)
    inside = StoreSettings(
        prefill_chunk=64, segment=SEGMENT, stream=StreamSettings(window=96, budget=48, always=True)
    )
    for sections, settings, mode in ((9, inside, "original"), (40, BOOK, "bounded")):
        doc = document(tmp_path, text_of(sections), name=f"{mode}.md")
        store, _ = open_or_build(small, doc, context_of(small, doc), settings)
        assert store.manifest["positions"]["mode"] == mode
        assert store.manifest["stream"]["parts"] > 1
        resident = load_file(store.path / "resident.safetensors")
        assert ("sketch" in resident) == (mode == "bounded")
        assert "k_bits" in resident  # keys in the even code, at any length
        offload = load_file(store.path / "offload.safetensors")
        # the records entropy-coded, as a short document's (as they are without the coder)
        assert ("k_coded" if entropy_coded() else "k_rows") in offload
        # the sinks are stored, first among the fixed rows, as 8-bit rows
        sinks = store.manifest["positions"]["sinks"]
        assert torch.equal(resident["fixed_pos"][:sinks], torch.arange(sinks))
        assert resident["fixed_k"].dtype == torch.int8
        assert resident["fixed_k"].shape[2] == resident["fixed_pos"].numel()
        R = resident["sketch_key"].shape[-1]
        built = dequantize_sketch(made["sketch"], R, torch.float32)
        rebuilt = dequantize_sketch(store.resident.sketch.cpu(), R, torch.float32)
        assert built.shape == rebuilt.shape
        off = (built - rebuilt).abs()
        assert float(off.max()) <= 1 and float((off > 0).float().mean()) < 0.25, mode
