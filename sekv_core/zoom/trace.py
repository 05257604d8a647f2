"""The zoom trace: what the router did during one answer, kept on the device until read.

Per span: in which (layer, KV head) it was zoomed, its best score against the threshold it had
to reach, and the share of attention its reconstructed tokens received. One host copy per
answer (:meth:`ZoomTrace.spans`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..native import kernels


@dataclass
class ZoomTrace:
    """What the router did during one answer, accumulated on the device (no host syncs)."""

    zoomed: torch.Tensor | None = None  # (L, H, N) bool: (layer, head) zoomed the span
    best_margin: torch.Tensor | None = None  # (N,) best score - threshold when zoomed
    best_score: torch.Tensor | None = None  # (N,) the score at that best margin
    tokens_max: torch.Tensor | None = None  # () most reconstructed tokens one (layer, head) used
    mass: torch.Tensor | None = None  # (N + 1,) attention share of zoomed tokens (+ padding)
    calls: int = 0  # attention calls that contributed to ``mass`` (layers x steps)
    # (L, H, T + 1) per layer and KV head the most attention one query predicting an answer token
    # paid each context token (its group's query heads summed / all query heads; the last column
    # collects free slots): see sekv_core.sources
    answer: torch.Tensor | None = None
    # at the first routing of each layer (the question's): (N,) how many KV heads zoomed each
    # span (summed over layers), and (L, H) each layer-head's first choice
    question_zoom: torch.Tensor | None = None
    question_top: torch.Tensor | None = None
    ranked_layers: set[int] = field(default_factory=set)

    def record(
        self,
        layer: int,
        num_layers: int,
        zoom: torch.Tensor,
        scores: torch.Tensor,
        threshold: torch.Tensor,
        lengths: torch.Tensor,
    ) -> None:
        """zoom, scores: (H, N); threshold: (H,)."""
        H, N = zoom.shape
        if self.zoomed is None:
            self.zoomed = torch.zeros(num_layers, H, N, dtype=torch.bool, device=zoom.device)
            self.best_margin = scores.new_full((N,), float("-inf"))
            self.best_score = scores.new_zeros(N)
            self.tokens_max = lengths.new_zeros(())
        if (
            layer in self.ranked_layers
            and scores.dtype == self.best_margin.dtype == torch.float32
            and lengths.dtype == torch.int64
            and kernels.usable(zoom, scores, threshold, lengths, self.zoomed)
        ):  # a decoding step's record: one native call on the CPU
            kernels.record(
                self.zoomed[layer],
                self.best_margin,
                self.best_score,
                self.tokens_max,
                zoom,
                scores,
                threshold,
                lengths,
            )
            return
        self.zoomed[layer] |= zoom
        margin = (scores - threshold[:, None]).masked_fill(~zoom, float("-inf"))  # (H, N)
        best, head = margin.max(dim=0)  # (N,)
        better = best > self.best_margin
        self.best_margin = torch.maximum(best, self.best_margin)
        self.best_score = torch.where(better, scores.gather(0, head[None])[0], self.best_score)
        used = (zoom * lengths[None]).sum(dim=1).max()
        self.tokens_max = torch.maximum(self.tokens_max, used)
        if layer not in self.ranked_layers:  # the question's routing
            self.ranked_layers.add(layer)
            if self.question_zoom is None:
                self.question_zoom = zoom.new_zeros(N, dtype=torch.long)
                self.question_top = torch.full((num_layers, H), -1, device=zoom.device)
            self.question_zoom = self.question_zoom + zoom.sum(dim=0)
            self.question_top[layer] = scores.argmax(dim=1)

    def add_mass(self, owner: torch.Tensor, pool_mass: torch.Tensor, n_spans: int) -> None:
        """Accumulate the attention share of zoomed tokens per span (stays on the device)."""
        if self.mass is None:
            self.mass = pool_mass.new_zeros(n_spans + 1)  # the last slot collects padding
        self.mass.index_add_(0, owner.flatten() % (n_spans + 1), pool_mass.flatten())
        self.calls += 1

    def add_answer(
        self, layer: int, num_layers: int, positions: torch.Tensor, mass: torch.Tensor, T: int
    ) -> None:
        """Keep the most attention per context token: one step's mass (H, M) per memory entry,
        whose context positions are ``positions`` (H, M) (``T``: no token)."""
        if self.answer is None:
            self.answer = mass.new_zeros(num_layers, mass.shape[0], T + 1)
        self.answer[layer].scatter_reduce_(1, positions, mass, reduce="amax")

    def add_step(
        self,
        layer: int,
        memory,
        mass: torch.Tensor,
        owner: torch.Tensor,
        slots: torch.Tensor,
        q_heads: int,
        attribute: bool,
    ) -> bool:
        """:meth:`add_mass` and (``attribute``) :meth:`add_answer` of one decoding step's query
        at once on the CPU: ``mass`` (H, 1, E) its attention over a memory's entries (the
        fixed rows, then every pool slot: ``owner``, ``slots`` (H, C)). False where the tensor
        code must run (another device or layout); the same sums and maxima."""
        if mass.shape[1] != 1 or mass.dtype != torch.float32:
            return False
        fixed = memory.fixed_positions[layer]
        span_positions = memory.span_positions
        if not kernels.usable(mass, owner, slots, fixed, span_positions):
            return False
        if self.mass is None:
            self.mass = mass.new_zeros(memory.n_spans + 1)
        if attribute and self.answer is None:
            self.answer = mass.new_zeros(memory.num_layers, mass.shape[0], memory.context_len + 1)
        answer = self.answer[layer] if attribute else None
        kernels.attention_trace(
            mass[:, 0],
            fixed.shape[1],
            q_heads,
            owner,
            self.mass,
            slots,
            fixed,
            span_positions,
            answer,
        )
        self.calls += 1
        return True

    def explain(self, index: torch.Tensor, scores: torch.Tensor | None = None) -> dict[str, Any]:
        """For spans ``index`` (a source's): in how many layers (and layer-heads) any was zoomed
        while answering; for the question, how many layer-heads zoomed the best of them and
        its rank among all spans by that count, and how many made one their first choice. A
        book's passages are ranked by ``scores`` (N,) instead (the question's words and its
        attention beyond the neutral question's, fused).
        Empty when nothing was recorded."""
        if self.zoomed is None or self.question_zoom is None or not index.numel():
            return {}
        index = index.to(self.zoomed.device)
        L, H, N = self.zoomed.shape
        held = self.zoomed[:, :, index].any(dim=2)  # (L, H)
        by = self.question_zoom.float() if scores is None else scores.float()
        best = index[by[index].argmax()]
        return {
            "layers_zoomed": int(held.any(dim=1).sum()),
            "layers": L,
            "zoomed_heads": int(held.sum()),
            "heads": L * H,
            "question_heads": int(self.question_zoom[best]),
            "first_choice": int(torch.isin(self.question_top, index).sum()),
            "rank": int((by > by[best]).sum()) + 1,
            "spans": N,
            "ranked_by": "router" if scores is None else "question",
        }

    def spans(self) -> list[dict]:
        """Per zoomed span: layers, (layer, head) pairs, best score/threshold, attention share.

        One host copy per answer.
        """
        if self.zoomed is None:
            return []
        layers = self.zoomed.any(dim=1).sum(dim=0)  # (N,)
        heads = self.zoomed.sum(dim=(0, 1))  # (N,)
        share = self.mass[:-1] / max(self.calls, 1) if self.mass is not None else heads * 0.0
        rows = torch.stack(
            [
                layers.float(),
                heads.float(),
                self.best_score.float(),
                (self.best_score - self.best_margin).float(),  # the threshold then
                share.float(),
            ],
            dim=1,
        ).tolist()
        return [
            {
                "span": n,
                "layers": int(r[0]),
                "heads": int(r[1]),
                "score": r[2],
                "threshold": r[3],
                "attention": r[4],
            }
            for n, r in enumerate(rows)
            if r[1] > 0
        ]

    @property
    def zoomed_tokens_max(self) -> int:
        return int(self.tokens_max) if self.tokens_max is not None else 0

    @property
    def zoom_rate(self) -> float:
        """Share of (layer, KV head, span) triples zoomed at least once during the answer."""
        return float(self.zoomed.float().mean()) if self.zoomed is not None else 0.0
