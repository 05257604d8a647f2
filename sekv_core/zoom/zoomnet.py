"""The trainable zoom-in: a relevance gate per (layer, query head).

It is tiny and sits beside the frozen base model (the only parameters ``sekv train`` learns).

**Relevance gate.** For a query q (post-RoPE) of layer l, query head h, and a span S, the gate logit

    z = a * (m_S - max m) + e * (n_S - max n) + c * (W q) . (W k_S) * scale
        + b * log|S| - tau

reads only the resident tier the training-free router reads (the 4-bit sketch): m_S is the sketch's
estimate of the span's max logit, n_S the log-sum-exp of its tokens' estimated logits (the span's
estimated attention mass), "max" the best value over the decision's queries, the head group and the
spans (the reference the training-free rule measures its margin from), k_S the span's mean key as
the sketch reconstructs it, W projects the query and k_S into one ``dim``-sized routing space (a
learned low-rank form: one matrix per layer and query head, so the parameters stay < 0.05% of the
default model), c weighs that term, b the log|S| prior, and tau is the learned zoom threshold. A
span is zoomed when z > 0. At initialisation (a=1, e=0, c=0, b=0, tau=-6) this is exactly the
training-free router's rule "within 6 nats of the best span", so training starts from the heuristic.

Router files (weights + manifest) are read and written by :mod:`sekv_core.router_files`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..sketch import segment_max, sketch_logits, sketch_rows, span_mean_keys

INIT_MARGIN = 6.0  # the training-free threshold the gate starts from (nats below the best span)


@dataclass(frozen=True)
class NetShape:
    """Sizes of the trainable modules (they follow the base model's attention geometry)."""

    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    dim: int = 3  # routing space

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


class ZoomGate(nn.Module):
    """Per (layer, query head) relevance gate over spans (see the module docstring)."""

    def __init__(self, shape: NetShape) -> None:
        super().__init__()
        L, H, D, R = shape.num_layers, shape.num_heads, shape.head_dim, shape.dim
        self.shape = shape
        g = torch.Generator().manual_seed(0)
        self.w_route = nn.Parameter(torch.randn(L, H, D, R, generator=g) * D**-0.5)
        self.route_weight = nn.Parameter(torch.zeros(L, H))  # starts without this term
        self.sketch_weight = nn.Parameter(torch.ones(L, H))
        self.mass_weight = nn.Parameter(torch.zeros(L, H))
        self.prior_weight = nn.Parameter(torch.zeros(L, H))
        self.threshold = nn.Parameter(torch.full((L, H), -INIT_MARGIN))

    def logits(
        self,
        layer: int,
        q: torch.Tensor,
        spans: SketchSpans,
        log_len: torch.Tensor,
        scaling: float,
        steps: torch.Tensor | None = None,
        span_keys: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Gate logits (Hkv, G, Tq, N).

        q : (Hkv, G, Tq, D) queries; spans : the sketch's per-span estimates for them
        (:func:`sketch_spans`); log_len : (N,); steps : (Tq,) the zoom decision each query
        serves (None: one decision for all of them, as when answering); span_keys: the spans'
        :meth:`span_keys`, if at hand. "Best" in the gate is the best over the decision's
        queries, the group's heads and the spans: the reference of the training-free rule,
        which ranks spans by their max logit over those queries.
        """
        Hkv, G = q.shape[:2]
        view = (Hkv, G, 1, 1)
        qr = torch.einsum("hgtd,hgdr->hgtr", q, self.route(layer, q.dtype))
        sr = (
            span_keys
            if span_keys is not None
            else self.span_keys(layer, spans.memory, q.dtype, spans.rows)
        )
        bilinear = torch.einsum("hgtr,hgnr->hgtn", qr, sr).float() * scaling
        bilinear = self.route_weight[layer].view(view) * bilinear
        peak, mass = spans.max_logit.float(), spans.log_mass.float()
        return (
            self.sketch_weight[layer].view(view) * (peak - decision_best(peak, steps))
            + self.mass_weight[layer].view(view) * (mass - decision_best(mass, steps))
            + bilinear
            + self.prior_weight[layer].view(view) * log_len.float()
            - self.threshold[layer].view(view)
        )

    def route(self, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """The routing maps W of ``layer``'s query heads, (Hkv, G, D, R)."""
        shape = self.shape
        w = self.w_route[layer].view(shape.num_kv_heads, shape.group, *self.w_route.shape[2:])
        return w.to(dtype)

    def span_keys(
        self, layer: int, memory: Any, dtype: torch.dtype, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each span's mean key (as the sketch of ``memory`` reconstructs it; ``rows``: its
        dequantised rows, if at hand) mapped by each query head's W, (Hkv, G, N, R): the same
        for every query, differentiable in W."""
        return span_mean_keys(memory, layer, self.route(layer, dtype), rows).to(dtype)


def step_best(z: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Best of z (Hkv, G, Tq, N) per KV head, step and span (Hkv, P, N) over the group's heads
    and the step's queries (``steps`` (Tq,) numbers each query's decision): the score each
    decision ranks by."""
    Hkv, _, Tq, N = z.shape
    per_pos = z.amax(dim=1)  # (Hkv, Tq, N)
    index = steps.to(z.device)[None, :, None].expand_as(per_pos)
    best = per_pos.new_full((Hkv, int(steps.max()) + 1, N), float("-inf"))
    return best.scatter_reduce(1, index, per_pos, reduce="amax", include_self=True)


def decision_best(x: torch.Tensor, steps: torch.Tensor | None) -> torch.Tensor:
    """Max of x (Hkv, G, Tq, N) over the group's heads, the spans and the queries of each
    decision (``steps`` (Tq,); None: all one), broadcast back: (Hkv, 1, Tq, 1), no gradient."""
    if steps is None:
        return x.amax(dim=(1, 2, 3))[:, None, None, None].detach()
    best = step_best(x.amax(dim=-1, keepdim=True), steps)  # (Hkv, P, 1)
    return best[:, steps.to(x.device)][:, None].detach()


class ZoomNet(nn.Module):
    """Everything ``sekv train`` learns: the relevance gate."""

    def __init__(self, shape: NetShape) -> None:
        super().__init__()
        self.shape = shape
        self.gate = ZoomGate(shape)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@dataclass
class SketchSpans:
    """What the sketch says about each span for a layer's queries (the gate's inputs)."""

    max_logit: torch.Tensor  # (Hkv, G, Tq, N) estimated max logit (scaled)
    log_mass: torch.Tensor  # (Hkv, G, Tq, N) log-sum-exp of the span's estimated logits
    # where they were read (a span memory or subset, its layer) and the layer's sketch rows
    # (Hkv, S, R) dequantised: what the spans' mean keys are made from, on demand
    memory: Any
    layer: int
    rows: torch.Tensor


def sketch_spans(memory, layer: int, q: torch.Tensor, scaling: float) -> SketchSpans:
    """The sketch's per-span estimates for queries ``q`` (Hkv, G, Tq, D) of ``layer``: one pass
    over the resident sketch (``memory``: a :class:`~sekv_core.zoom.memory.SpanMemory` or a
    subset)."""
    values = sketch_rows(memory, layer, q.dtype)  # dequantised once for both uses
    logits = sketch_logits(memory, layer, q, values=values) * scaling  # (H, G, Tq, S)
    shape, n = logits.shape[:-1], memory.n_spans
    flat = logits.reshape(-1, logits.shape[-1]).float()
    peak = segment_max(flat, memory.sketch_span, n)  # (H*G*Tq, N)
    shifted = (flat - peak.gather(1, memory.sketch_span[None].expand_as(flat))).exp()
    total = flat.new_zeros(flat.shape[0], n).index_add_(1, memory.sketch_span, shifted)
    log_mass = peak + total.clamp(min=1e-30).log()
    return SketchSpans(peak.view(*shape, n), log_mass.view(*shape, n), memory, layer, values)
