"""The prefilter of long documents: representatives, the coarse block index, candidates."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model

import sekv_core.zoom.chunks as chunks
import sekv_core.zoom.prefilter as prefilter_mod
from sekv_core.config import SegmentSettings, StoreSettings, StreamSettings
from sekv_core.documents import Document, load_document
from sekv_core.engine import Session
from sekv_core.methods import MethodSettings
from sekv_core.models import load_model
from sekv_core.segment import SPAN
from sekv_core.zoom.prefilter import RepBlocks, candidates, representative_scores
from sekv_core.zoom.router import SketchRouter

WINDOW = 512  # a book is a few windows long: a bounded, streamed store of many spans
BOOK = StoreSettings(
    prefill_chunk=64,
    segment=SegmentSettings(min_len=8, max_len=32),
    stream=StreamSettings(window=96, budget=48, route_queries=8),
)
WORDS = ["north", "south", "old", "new", "red", "blue"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A tiny Llama with a 512-token window."""
    path = build_tiny_model(tmp_path_factory.mktemp("small-window") / "llama", "llama", WINDOW)
    return load_model(str(path), device="cpu")


def book(tmp_path: Path, sections: int = 24) -> Document:
    path = tmp_path / "book.md"
    path.write_text(
        "\n\n".join(
            f"Section {i}. The {WORDS[i % 6]} vault on floor {i % 9} holds crate {i * 37 % 101}."
            for i in range(sections)
        )
    )
    return load_document(path)


def test_prefilter_scores_candidates_exactly(small, tmp_path, monkeypatch):
    """Books with many spans: routers score only the spans whose representative tokens (their
    highest-surprisal ones) score among the best; the candidates keep their exact scores."""
    monkeypatch.setattr(chunks, "STREAM_PREFILTER_SPANS", 8)  # streamed chunks prefilter
    doc = book(tmp_path)
    settings = MethodSettings(budget=16, store=BOOK)
    session = Session(small, doc, "sekv", settings)
    memory, store = session.method.spans, session.method.store
    tables = memory.rep_tables
    assert tables is not None and memory.n_spans > 8
    span_tokens = torch.nonzero(store.trace["roles"] == SPAN)[:, 0]  # sketch rows -> tokens
    reps = span_tokens[tables.span_reps]  # (N, 4) token positions
    assert ((reps >= memory.starts[:, None]) & (reps < memory.ends[:, None])).all()
    h = store.trace["surprisal"]
    for n in range(memory.n_spans):  # each span's best token is among its representatives
        s, e = int(memory.starts[n]), int(memory.ends[n])
        assert h[reps[n]].max() == h[s:e].max()
    torch.manual_seed(0)
    H, D = memory.num_kv_heads, memory.head_dim
    q = torch.randn(H, 2, 3, D)
    for layer in range(memory.num_layers):
        exact = SketchRouter().scores(memory, layer, q, 1.0)  # (H, N)
        assert (representative_scores(tables, layer, q) <= exact + 1e-4).all()
        index = candidates(tables, layer, q, budget=16, keep=4, min_spans=8)
        assert 4 <= len(index) < memory.n_spans
        sub = SketchRouter().scores(memory.subset(layer, index), layer, q, 1.0)
        assert torch.allclose(sub, exact[:, index], atol=1e-4)
    answer = session.ask("Which crate is on floor 4?", max_new_tokens=4)
    assert answer.routing["zoomed_tokens_max"] <= 16


def test_block_index_bounds_every_representative_and_grows_with_the_store(
    small, tmp_path, monkeypatch
):
    """The coarse index a streamed chunk's prefilter reads: no representative scores above its
    block's bound; grown span by span it equals one built at once (and is rebuilt when the
    sketch's scale changes); the candidates come from the opened blocks and the tail only, and
    with every block opened they are the flat prefilter's."""
    monkeypatch.setattr(prefilter_mod, "BLOCK_SPANS", 4)
    doc = book(tmp_path)
    session = Session(small, doc, "sekv", MethodSettings(budget=16, store=BOOK))
    memory = session.method.spans
    tables = memory.rep_tables
    n, B = memory.n_spans, 4
    assert n > 6 * B
    torch.manual_seed(0)
    q = torch.randn(memory.num_kv_heads, 2, 3, memory.head_dim)
    index = RepBlocks()
    index.update(tables)
    assert index.n_blocks == n // B
    for layer in range(memory.num_layers):
        reps = representative_scores(tables, layer, q)[:, : index.n_blocks * B]
        block_best = reps.view(reps.shape[0], -1, B).amax(dim=-1)
        assert (block_best <= index.bounds(tables, layer, q) + 1e-4).all()

    def prefix(k: int, scale: torch.Tensor) -> prefilter_mod.RepTables:
        """The tables as a streamed build saw them after its first ``k`` spans."""
        return replace(
            tables, span_reps=tables.span_reps[:k], lengths=tables.lengths[:k], sketch_scale=scale
        )

    grown = RepBlocks()
    for k in range(1, n + 1):
        grown.update(prefix(k, tables.sketch_scale))
    assert torch.equal(grown.lo, index.lo) and torch.equal(grown.hi, index.hi)
    grown.update(prefix(2 * B + 1, tables.sketch_scale * 2))  # levels re-read: rebuilt
    assert grown.n_blocks == 2 and torch.equal(grown.hi, index.hi[:, :, :2])

    monkeypatch.setattr(prefilter_mod, "OPEN_FACTOR", 1)
    opened = prefilter_mod.opened_spans(tables, index, 0, q, keep=4)
    assert B * 1 <= len(opened) < n and (opened >= index.n_blocks * B).sum() == n % B
    picked = candidates(tables, 0, q, budget=4, keep=4, min_spans=8, blocks=index)
    assert torch.isin(picked, opened).all()
    monkeypatch.setattr(prefilter_mod, "OPEN_FACTOR", n)  # every block opened
    for layer in range(memory.num_layers):
        flat = candidates(tables, layer, q, budget=16, keep=4, min_spans=8)
        assert torch.equal(candidates(tables, layer, q, 16, 4, 8, blocks=index), flat)
