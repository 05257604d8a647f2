"""Routing: which spans to zoom into, per layer and KV head, for the current queries.

A router estimates, for every span, the largest attention logit any current query of a KV head's
group would give one of the span's tokens (scaled, natural-log units). :func:`select` then zooms
the best spans under a token budget, but only those within ``margin`` of the best span: a span
whose best token would weigh e^-margin of the best one is not worth its reconstruction.

Two routers, behind one ``scores`` method:

- ``sketch`` (training-free): each span key reduced to a few numbers (32 dims, 4-bit, resident;
  see :mod:`sekv_core.sketch`); a span scores its max estimated logit.
- ``trained`` (:class:`TrainedRouter`, ``sekv train``): a learned gate whose logit is > 0 for
  spans to zoom (its threshold replaces the margin rule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from ..native import kernels
from ..sketch import reads_natively, segment_max, sketch_logits
from .zoomnet import ZoomGate, ZoomNet, sketch_spans

T = TypeVar("T")

if TYPE_CHECKING:  # routers read the memory they are given (or a subset of it)
    from .memory import SpanMemory


class Router(Protocol):
    name: str

    def scores(
        self, memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """q: (H_kv, G, Tq, D) queries of one layer -> (H_kv, N) estimated max logit per span."""
        ...


class SketchRouter:
    """The training-free router: each span's best logit estimated from its routing sketch."""

    name = "training-free"

    def __init__(self) -> None:
        self._sketches: dict[int, tuple] = {}  # per layer, :func:`kept` native_sketch

    def scores(
        self, memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        if reads_natively(memory, layer, q):
            sketch = kept(self._sketches, memory, layer, lambda: native_sketch(memory, layer))
            first_row, lengths = memory.first_row, memory.host_lengths
            return kernels.sketch_scores(q.contiguous(), sketch, scaling, first_row, lengths)
        logits = sketch_logits(memory, layer, q)  # (H, G, Tq, S)
        best = logits.amax(dim=(1, 2)) * scaling  # (H, S)
        return segment_max(best, memory.sketch_span, memory.n_spans)


def kept(cache: dict[int, tuple], memory: SpanMemory, layer: int, make: Callable[[], T]) -> T:
    """What ``make()`` gives for ``layer``, kept in ``cache`` while the memory and its sketch
    stay the same (an answer's steps), made again when either changes."""
    entry = cache.get(layer)
    if entry is None or entry[0] is not memory or entry[1] is not memory.sketch:
        entry = cache[layer] = (memory, memory.sketch, make())
    return entry[2]


def native_sketch(memory: SpanMemory, layer: int) -> tuple[torch.Tensor, ...]:
    """``layer``'s sketch as the native kernels read it: its directions (H, D, R), scale (H, R)
    and mean key (H, D) as float32, and its 4-bit codes (H, S, R / 2), column-major."""
    return (
        memory.sketch_proj[layer].float().contiguous(),
        memory.sketch_scale[layer].float().contiguous(),
        memory.sketch_mean[layer].float().contiguous(),
        memory.sketch[layer],
    )


class TrainedRouter:
    """The learned relevance gate (:mod:`sekv_core.zoom.zoomnet`): a span is zoomed for a KV head
    when any query head of its group, at any current query, gives it a gate logit > 0."""

    name = "trained"

    def __init__(self, net: ZoomNet) -> None:
        self.net = net
        self._layers: dict[int, tuple] = {}  # per layer, :func:`kept` GateLayer

    def scores(
        self, memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        kept = self.gate_layer(memory, layer, q.dtype)
        if kept is not None and kept.native is not None and reads_natively(memory, layer, q):
            sketch, gate = kept.native
            first_row, lengths = memory.first_row, memory.host_lengths
            return kernels.gate_scores(q.contiguous(), sketch, first_row, lengths, gate, scaling)
        spans = sketch_spans(memory, layer, q, scaling)
        keys = None if kept is None else kept.keys
        z = self.net.gate.logits(layer, q, spans, memory.log_len, scaling, span_keys=keys)
        return z.amax(dim=(1, 2))

    def gate_layer(self, memory: SpanMemory, layer: int, dtype: torch.dtype) -> GateLayer | None:
        """What ``layer``'s scores reuse while the memory's sketch stays the same (an answer's
        steps); None for a subset of a memory (the prefilter's: its spans change each step)."""
        if getattr(memory, "first_row", None) is None:
            return None
        return kept(
            self._layers, memory, layer, lambda: GateLayer.make(self.net.gate, memory, layer, dtype)
        )


@dataclass
class GateLayer:
    """One layer's gate inputs that do not depend on the queries: the spans' mapped mean keys
    and, for the native kernel, the sketch and the gate's weights as float32 arrays."""

    keys: torch.Tensor  # (Hkv, G, N, K)
    native: tuple | None  # kernels.gate_scores' sketch and gate arguments; None: tensor code

    @staticmethod
    def make(gate: ZoomGate, memory: SpanMemory, layer: int, dtype: torch.dtype) -> GateLayer:
        keys = gate.span_keys(layer, memory, dtype).detach()
        native = None
        if dtype == torch.float32:
            sketch = native_sketch(memory, layer)
            view = keys.shape[:2]
            weights = [gate.sketch_weight, gate.mass_weight, gate.route_weight, gate.prior_weight]
            coef = torch.stack([w[layer].view(view) for w in [*weights, gate.threshold]], -1)
            route = gate.route(layer, torch.float32).contiguous()
            log_len = memory.log_len.float().contiguous()
            gate_args = (route.detach(), keys.contiguous(), coef.detach().contiguous(), log_len)
            if kernels.usable(*sketch[:3], *gate_args):
                native = (sketch, gate_args)
        return GateLayer(keys, native)


SELECT_ROUNDS = 4  # batched greedy passes of :func:`select`


def select(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    budget: int,
    margin: float | None,
    rounds: int = SELECT_ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zoom decision per KV head: best spans first while the token budget lasts; a span that no
    longer fits is skipped and the next ones are tried (greedy by score).

    scores : (H, N) estimated max logits (or gate logits when ``margin`` is None: then a span
    must score above 0); lengths : (N,) span lengths.
    Returns zoom (H, N) bool and the per-head threshold (H,) a span had to reach.

    Greedy in rank order is computed in ``rounds`` batched passes: each pass takes the longest
    prefix (in rank order) of the still-eligible spans that fits in what is left; the spans left
    out are only those the greedy order would skip or reach later. Exact when at most
    ``rounds - 1`` spans are skipped (else the last pass stops at its cut). The passes run over
    the best-ranked spans only, enough to fill the budget twice over with the shortest spans;
    for a head whose lower-ranked spans could still have taken part, over every span (so a
    head's decision never depends on the other heads'). Spans of equal score go in document
    order. On the CPU the same decision is one native call (:mod:`sekv_core.native.kernels`).
    """
    if (
        scores.dtype == torch.float32
        and lengths.dtype == torch.int64
        and kernels.usable(scores, lengths)
    ):
        return kernels.select(scores, lengths, budget, margin, rounds)
    if margin is None:
        threshold = scores.new_zeros(scores.shape[0])
    else:
        threshold = scores.amax(dim=1) - margin  # (H,)
    N = scores.shape[1]
    shortest = max(1, int(lengths.min())) if N else 1
    ranks = min(N, 2 * (budget // shortest) + 4 * rounds)
    ranked, order = scores.sort(dim=1, descending=True, stable=True)  # ties: document order
    taken, left = greedy_passes(
        ranked[:, :ranks], lengths[order[:, :ranks]], threshold, budget, rounds
    )
    zoom = torch.zeros_like(scores, dtype=torch.bool).scatter(1, order[:, :ranks], taken)
    reachable = (ranked[:, ranks - 1] >= threshold) & (left >= shortest) if ranks < N else None
    if reachable is not None and bool(reachable.any()):  # lower ranks could still take a span
        rows = reachable.nonzero()[:, 0]
        taken, _ = greedy_passes(
            ranked[rows], lengths[order[rows]], threshold[rows], budget, rounds
        )
        zoom[rows] = torch.zeros_like(taken).scatter(1, order[rows], taken)
    return zoom, threshold


def greedy_passes(
    ranked: torch.Tensor,
    ranked_len: torch.Tensor,
    threshold: torch.Tensor,
    budget: int,
    rounds: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select`'s passes over spans in rank order: scores ``ranked`` (H, K), lengths
    ``ranked_len`` (H, K). Returns which are taken (H, K) and the tokens left per head (H,)."""
    open_ = ranked >= threshold[:, None]  # above the threshold, undecided
    taken = torch.zeros_like(open_)
    left = torch.full_like(ranked_len[:, :1], budget)  # (H, 1) tokens left
    for _ in range(rounds):
        open_ = open_ & (ranked_len <= left)  # what no longer fits is skipped for good
        used = (ranked_len * open_).cumsum(dim=1)
        take = open_ & (used <= left)
        taken |= take
        open_ &= ~take
        left = left - (ranked_len * take).sum(dim=1, keepdim=True)
    return taken, left[:, 0]
