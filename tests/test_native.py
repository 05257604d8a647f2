"""The decode step's native kernels (sekv_core/native.py) decide exactly as the tensor code."""

from __future__ import annotations

import shutil

import pytest
import torch

from sekv_core import native
from sekv_core.attention import widen
from sekv_core.router import select
from sekv_core.trace import ZoomTrace

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler on this machine"
)


@pytest.fixture
def tensor_code(monkeypatch):
    """Run the tensor code (what a GPU runs) instead of the kernels inside the block."""

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(native, "usable", lambda *tensors: False)
            return fn(*args, **kwargs)

    return run


def test_the_kernels_build_and_load(tmp_path):
    assert native.library() is not None
    assert native.usable(torch.zeros(2, 3))
    assert not native.usable(torch.zeros(2, 3).t())  # not contiguous: the tensor code
    assert not native.usable(torch.zeros(2, requires_grad=True))


def test_a_damaged_library_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SEKV_HOME", str(tmp_path))
    compiler = shutil.which("cc") or shutil.which("gcc")
    path = native._built(compiler)
    path.write_bytes(b"not a library")
    native.library.cache_clear()
    try:
        assert native.library() is not None
        assert path.read_bytes()[:4] == b"\x7fELF"
    finally:
        native.library.cache_clear()


def scores_with_ties(g: torch.Generator, H: int, N: int) -> torch.Tensor:
    """Widened scores: a span and its neighbours often share a score."""
    raw = torch.randn(H, N, generator=g) * 3
    return torch.nn.functional.max_pool1d(raw[:, None], 3, 1, 1)[:, 0]


def test_select_decides_as_the_tensor_code_ties_included(tensor_code):
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        N = int(torch.randint(1, 1200, (1,), generator=g))
        scores = scores_with_ties(g, 3, N)
        lengths = torch.randint(1, 12, (N,), generator=g)
        budget = int(torch.randint(0, 400, (1,), generator=g))
        margin = None if trial % 4 == 0 else 6.0
        rounds = 1 + trial % 5
        zoom, threshold = select(scores, lengths, budget, margin, rounds)
        want, want_threshold = tensor_code(select, scores, lengths, budget, margin, rounds)
        assert torch.equal(threshold, want_threshold)
        assert torch.equal(zoom, want), trial
        assert (lengths * zoom).sum(dim=1).le(budget).all()


def test_select_of_equal_scores_goes_in_document_order():
    scores = torch.zeros(1, 6)
    lengths = torch.tensor([3, 3, 3, 3, 3, 3])
    zoom, _ = select(scores, lengths, budget=9, margin=1.0)
    assert zoom[0].tolist() == [True, True, True, False, False, False]


def test_widen_is_the_tensor_code(tensor_code):
    g = torch.Generator().manual_seed(1)
    for neighbours in (1, 2, 5):
        scores = torch.randn(3, 257, generator=g)
        scores[0, 7] = float("-inf")
        assert torch.equal(widen(scores, neighbours), tensor_code(widen, scores, neighbours))


def test_the_trace_records_as_the_tensor_code(tensor_code):
    g = torch.Generator().manual_seed(2)
    L, H, N = 3, 2, 50
    lengths = torch.randint(1, 9, (N,), generator=g)
    fast, slow = ZoomTrace(), ZoomTrace()
    for _ in range(6):
        for layer in range(L):
            scores = scores_with_ties(g, H, N)
            zoom, threshold = select(scores, lengths, 60, 4.0)
            fast.record(layer, L, zoom, scores, threshold, lengths)
            tensor_code(slow.record, layer, L, zoom, scores, threshold, lengths)
    for name in ("zoomed", "best_margin", "best_score", "tokens_max", "question_zoom"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert fast.spans() == slow.spans()
