"""Zoom pools on their own: slots, reuse, eviction and reading order, without a memory."""

from __future__ import annotations

import torch

from sekv_core.kvquant import Rows
from sekv_core.passages import placement
from sekv_core.zoom.pools import ZoomPool

D = 4
LENGTHS = torch.tensor([2, 3, 1, 2])  # four spans' tokens
FIRST_ROW = torch.cumsum(LENGTHS, 0) - LENGTHS


def reader(log: list[tuple[int, int]]):
    """Rows of (span, head) pairs whose every entry is the pair's span + 10 x head, logged."""

    def read(spans: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log.extend(zip(spans.tolist(), heads.tolist(), strict=True))
        value = (spans + 10 * heads).float().repeat_interleave(LENGTHS[spans])
        rows = value[:, None].expand(-1, D).contiguous()
        return rows, rows

    return read


def picks(*rows: list[int]) -> torch.Tensor:
    zoom = torch.zeros(len(rows), len(LENGTHS), dtype=torch.bool)
    for head, spans in enumerate(rows):
        zoom[head, spans] = True
    return zoom


def test_a_pool_reads_only_what_it_lacks_and_evicts_the_least_recently_active():
    log: list[tuple[int, int]] = []
    read = reader(log)
    first = picks([0, 1], [2])
    pool = ZoomPool.empty(first, capacity=5, head_dim=D, kv_bits=16, device=torch.device("cpu"))
    assert pool.update(first, None, read, LENGTHS, FIRST_ROW) == 6
    assert sorted(log) == [(0, 0), (1, 0), (2, 1)]
    assert pool.holds(first, None) and pool.tokens == 10
    log.clear()
    second = picks([1, 3], [2])  # head 0 drops span 0, takes span 3 into its slots
    assert pool.update(second, None, read, LENGTHS, FIRST_ROW) == 2
    assert log == [(3, 0)]
    keys, _ = pool.kv(torch.float32)
    active = pool.active[0]
    assert sorted(keys[0, active, 0].tolist()) == [1.0] * 3 + [3.0] * 2
    assert set(pool.owner[0, active].tolist()) == {1, 3}
    log.clear()
    pool.update(picks([0, 1, 2, 3], [2]), None, read, LENGTHS, FIRST_ROW)  # 8 > 5: widens
    assert sorted(log) == [(0, 0), (2, 0)] and pool.owner.shape[1] == 8


def test_a_pool_reads_its_passages_by_placement_each_in_document_order():
    # one head, six slots: spans 0 (tokens 0-1), 3 (tokens 5-6), 5 (token 9); slot 5 free
    owner = torch.tensor([[3, 0, 5, 0, 3, -1]])
    token = torch.tensor([[6, 1, 9, 0, 5, -1]])
    active = owner >= 0
    pool = ZoomPool(
        rows=Rows.empty((2, 1, 6), 4, 8, torch.device("cpu")),
        owner=owner,
        last=torch.zeros_like(owner),
        held=torch.zeros(1, 6, dtype=torch.bool),
        zoom=torch.zeros(1, 6, dtype=torch.bool),
        active=active,
        bias=torch.zeros(1, 6),
        pool_end=20,
        token=token,
        kv_bits=8,
    )
    tokens = lambda order: token[0, order[0, :5]].tolist()  # noqa: E731
    assert tokens(pool.document_order()) == [0, 1, 5, 6, 9]
    pool.order = None  # a new update
    chosen = torch.tensor([1, 0, 0, 1, 0, 1], dtype=torch.bool)  # three passages
    place = placement(chosen, torch.tensor([0.9, 0, 0, 0.1, 0, 0.5]))
    # span 0's passage (0.9) last, next to the question; span 3's (0.1) first
    assert tokens(pool.document_order(place)) == [5, 6, 9, 0, 1]
