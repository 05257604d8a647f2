import torch

from sekv_core.zoom.router import greedy_passes, segment_max, select


def test_select_prefers_best_spans_within_budget_and_margin():
    scores = torch.tensor([[5.0, 9.0, 8.5, 1.0, 8.9], [0.0, 0.0, 10.0, 9.5, -3.0]])
    lengths = torch.tensor([10, 20, 20, 5, 30])
    zoom, thr = select(scores, lengths, budget=45, margin=2.0)
    # head 0: 9.0 (20); 8.9 (30) no longer fits and is skipped; 8.5 (20) fits; margin excludes
    # 5.0 and 1.0
    assert zoom[0].tolist() == [False, True, True, False, False]
    assert zoom[1].tolist() == [False, False, True, True, False]
    assert thr.tolist() == [7.0, 8.0]
    for h in range(2):
        assert int(lengths[zoom[h]].sum()) <= 45


def test_segment_max():
    values = torch.tensor([[1.0, 5.0, 2.0, 7.0, 0.0]])
    ids = torch.tensor([0, 0, 1, 1, 2])
    assert segment_max(values, ids, 3).tolist() == [[5.0, 7.0, 0.0]]


def greedy(scores: list[float], lengths: list[int], budget: int, threshold: float) -> list[bool]:
    """The reference: spans in descending score, each taken if it fits in what is left."""
    taken, left = [False] * len(scores), budget
    for i in sorted(range(len(scores)), key=lambda i: -scores[i]):
        if scores[i] >= threshold and lengths[i] <= left:
            taken[i], left = True, left - lengths[i]
    return taken


def test_select_is_greedy_by_score_skipping_what_does_not_fit():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        H, N = 3, int(torch.randint(1, 40, (1,), generator=g))
        scores = torch.randn(H, N, generator=g) * 3
        lengths = torch.randint(1, 60, (N,), generator=g)
        budget = int(torch.randint(0, 400, (1,), generator=g))
        margin = None if trial % 2 else 4.0
        zoom, thr = select(scores, lengths, budget, margin, rounds=N + 1)
        for h in range(H):
            want = greedy(scores[h].tolist(), lengths.tolist(), budget, float(thr[h]))
            assert zoom[h].tolist() == want
        few, _ = select(scores, lengths, budget, margin)  # the default rounds
        assert ((few & ~zoom).sum() == 0) and (lengths * few).sum(1).le(budget).all()


def test_select_over_the_best_ranks_decides_as_over_every_span():
    """Many spans, a small budget: the passes over the best-ranked spans pick what the passes
    over every span pick (scores without ties), and fall back to every span when a span ranked
    below could still be taken."""
    g = torch.Generator().manual_seed(1)
    for trial in range(100):
        N = int(torch.randint(100, 900, (1,), generator=g))
        scores = torch.randn(3, N, generator=g) * 3
        lengths = torch.randint(4, 9, (N,), generator=g)
        if trial % 3 == 0:  # long spans at the top: most of them no longer fit
            lengths[scores[0].argsort(descending=True)[:40]] = 60
        budget = int(torch.randint(16, 300, (1,), generator=g))
        margin = None if trial % 2 else 6.0
        zoom, thr = select(scores, lengths, budget, margin)
        ranked, order = scores.sort(dim=1, descending=True)
        taken, _ = greedy_passes(ranked, lengths[order], thr, budget, 4)
        want = torch.zeros_like(taken).scatter(1, order, taken)
        assert torch.equal(zoom, want)
