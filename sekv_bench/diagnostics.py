"""Routing diagnostics: the oracle router, and a probe that holds SeKV's routing against it.

The oracle scores each span by the exact max attention logit over its reconstructed keys: it
reads every span's basis, so it saves nothing, but at the same token budget it is the routing a
cheaper router should match. :class:`RoutingProbe` implements the engine's observer hook
(:data:`sekv_core.zoom.attention.Observer`): attached to a SeKV answer (:func:`attach_probe`),
it sees every routing decision and measures

- ``recall_vs_oracle``: the share of the oracle's picks the router picked too;
- ``mass_captured``: the share of the exact span attention (a softmax over every span token with
  its exact key) the router's picks hold, and ``oracle_mass_captured`` the oracle's picks'.

None of this runs when answering: the engine only calls its observer, when one is set.
"""

from __future__ import annotations

import torch

from sekv_core.config import MethodSettings
from sekv_core.engine import Answer, Session
from sekv_core.methods import SeKV
from sekv_core.sketch import segment_max
from sekv_core.zoom.attention import ZoomPolicy, widen
from sekv_core.zoom.memory import SpanMemory, SpanSubset
from sekv_core.zoom.router import Router, select


class SpanKeys:
    """Every span token's reconstructed key, per layer, of one :class:`SpanMemory` (what the
    oracle reads). Kept apart from the zoom pools and not counted as answer memory; rebuilt when
    the memory changes (another session, or a streamed store that grew). Bounded memories' keys
    are pre-RoPE: the routers' frame."""

    def __init__(self) -> None:
        self.memory: SpanMemory | None = None
        self.n_spans = 0
        self.layers: dict[int, torch.Tensor] = {}

    def __call__(self, memory: SpanMemory | SpanSubset, layer: int) -> torch.Tensor:
        """(H, S, D) keys of ``layer``'s span tokens, in document order (a subset's own rows)."""
        if isinstance(memory, SpanSubset):
            return self(memory.memory, layer)[:, memory.rows]
        if memory is not self.memory or memory.n_spans != self.n_spans:
            self.memory, self.n_spans, self.layers = memory, memory.n_spans, {}
        if layer not in self.layers:
            H, N = memory.num_kv_heads, memory.n_spans
            if N:
                heads = torch.arange(H).repeat_interleave(N)
                keys, _ = memory.reconstruct(layer, torch.arange(N).repeat(H), heads)
                keys = keys.view(H, -1, memory.head_dim)
            else:
                keys = torch.zeros(H, 0, memory.head_dim, device=memory.device)
            self.layers[layer] = keys
        return self.layers[layer]


class OracleRouter:
    """The exact max logit over each span's reconstructed keys (a diagnostic router)."""

    name = "oracle"

    def __init__(self, keys: SpanKeys | None = None) -> None:
        self.keys = keys or SpanKeys()

    def scores(
        self, memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """q: (H, G, Tq, D) -> (H, N) exact max logit per span."""
        keys = self.keys(memory, layer)  # (H, S, D) every span token, reconstructed
        logits = torch.einsum("hgtd,hsd->hgts", q, keys.to(q.dtype))
        best = logits.amax(dim=(1, 2)) * scaling  # (H, S)
        return segment_max(best, memory.sketch_span, memory.n_spans)


class MarginRouter:
    """Another router's scores shifted so that 0 is its margin threshold: a margin-ruled router
    (the oracle) then decides as an absolute-threshold one (a trained gate) does."""

    def __init__(self, inner: Router, margin: float) -> None:
        self.inner, self.margin, self.name = inner, margin, inner.name

    def scores(
        self, memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        s = self.inner.scores(memory, layer, q, scaling)
        return s - (s.amax(dim=1, keepdim=True) - self.margin)


def exact_span_share(
    memory: SpanMemory, layer: int, q: torch.Tensor, scaling: float, keys: SpanKeys
) -> torch.Tensor:
    """(H, N) each span's share of the attention that queries ``q`` (H, G, Tq, D) give the span
    tokens with their exact keys (a softmax over span tokens only), averaged over the group's
    heads and the queries: what a zoom decision should hold."""
    k = keys(memory, layer)  # (H, S, D)
    probs = (torch.einsum("hgtd,hsd->hgts", q, k.to(q.dtype)).float() * scaling).softmax(-1)
    per_row = probs.mean(dim=(1, 2))  # (H, S)
    share = per_row.new_zeros(per_row.shape[0], memory.n_spans)
    return share.index_add_(1, memory.sketch_span, per_row)


class RoutingProbe:
    """Observer of SeKV's routing decisions: what the oracle would have zoomed at the same
    budget (every span scored, no prefilter; widened by the policy's neighbours), and the exact
    span attention each selection holds. Accumulated on the device; one answer at a time (a new
    policy, i.e. a new answer, starts over).

    ``margin``: the oracle's margin when the policy has none (a trained router's gate decides
    by its own threshold; the oracle keeps the training-free margin rule).
    """

    def __init__(self, margin: float = MethodSettings.margin) -> None:
        self.margin = margin
        self.keys = SpanKeys()
        self.oracle = OracleRouter(self.keys)
        self.reset()

    def reset(self) -> None:
        self.policy: ZoomPolicy | None = None
        self.recall: torch.Tensor | None = None  # (2,) oracle picks also picked, oracle picks
        # (3,) summed over decisions: exact span attention held by the picks, by the oracle's
        # picks, and the number of decisions
        self.captured: torch.Tensor | None = None

    def __call__(
        self,
        policy: ZoomPolicy,
        memory: SpanMemory,
        layer: int,
        q: torch.Tensor,
        scaling: float,
        zoom: torch.Tensor,
    ) -> None:
        """One decision: ``zoom`` (H, N) bool, made for queries ``q`` (H, G, Tq, D)."""
        if policy is not self.policy:
            self.reset()
            self.policy = policy
        if policy.margin is None:
            oracle, margin = MarginRouter(self.oracle, self.margin), None
        else:
            oracle, margin = self.oracle, policy.margin
        best = widen(oracle.scores(memory, layer, q, scaling), policy.neighbours)
        want, _ = select(best, memory.lengths, policy.budget, margin)
        hits = torch.stack([(zoom & want).sum(), want.sum()])
        self.recall = hits if self.recall is None else self.recall + hits
        share = exact_span_share(memory, layer, q, scaling, self.keys)
        held = torch.stack([(zoom * share).sum(), (want * share).sum()]) / zoom.shape[0]
        step = torch.cat([held.float(), held.new_ones(1).float()])
        self.captured = step if self.captured is None else self.captured + step

    def report(self) -> dict[str, float]:
        """The last answer's figures (empty when it made no routing decision)."""
        if self.recall is None or self.captured is None:
            return {}
        hits, total = self.recall.tolist()
        zoomed, oracle, n = self.captured.tolist()
        return {
            "recall_vs_oracle": round(hits / total if total else 1.0, 4),
            "mass_captured": round(zoomed / n, 4),
            "oracle_mass_captured": round(oracle / n, 4),
        }


def attach_probe(session: Session) -> RoutingProbe | None:
    """A probe observing ``session``'s routing (SeKV methods; None for methods without it)."""
    method = session.method
    if not isinstance(method, SeKV):
        return None
    probe = RoutingProbe(method.settings.margin)
    method.observer = probe
    return probe


def ask_probed(
    session: Session, question: str, max_new_tokens: int, probe: RoutingProbe | None
) -> Answer:
    """``session.ask``, with the probe's figures (when there is a probe) merged into the
    answer's routing summary."""
    if probe is not None:
        probe.reset()
    answer = session.ask(question, max_new_tokens)
    if probe is not None:
        answer.routing = {**answer.routing, **probe.report()}
    return answer
