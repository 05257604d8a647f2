import torch

from sekv_core.router import segment_max, select


def test_select_prefers_best_spans_within_budget_and_margin():
    scores = torch.tensor([[5.0, 9.0, 8.5, 1.0, 8.9], [0.0, 0.0, 10.0, 9.5, -3.0]])
    lengths = torch.tensor([10, 20, 20, 5, 30])
    zoom, thr = select(scores, lengths, budget=45, margin=2.0)
    # head 0: 9.0 (20) + 8.9 (30) would exceed 45 -> only the best fits; margin excludes 5.0, 1.0
    assert zoom[0].tolist() == [False, True, False, False, False]
    assert zoom[1].tolist() == [False, False, True, True, False]
    assert thr.tolist() == [7.0, 8.0]
    for h in range(2):
        assert int(lengths[zoom[h]].sum()) <= 45


def test_segment_max():
    values = torch.tensor([[1.0, 5.0, 2.0, 7.0, 0.0]])
    ids = torch.tensor([0, 0, 1, 1, 2])
    assert segment_max(values, ids, 3).tolist() == [[5.0, 7.0, 0.0]]
