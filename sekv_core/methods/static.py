"""Static semantic memory (SentenceKV-like): spans fixed at prefill, never zoomed.

The context is cut into spans by the same entropy segmentation and span store SeKV uses, but
answering attends, in one softmax, to the sinks + anchors, ONE summary entry per span (its logit
gets + log|S|) and the local window (question + answer tokens) — nothing is ever reconstructed.
It is SeKV with zoom disabled and summaries on: the offload tier (the bases) is never read, so
it does not count as this method's memory, and neither does the routing sketch (never read).

Its memory is fixed by the segmentation: it cannot follow ``memory_ratio`` or ``budget``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention import ZoomPolicy
from .sekv import SeKV


class NoZoom:
    """A router that rates every span equally; with a zero budget nothing is ever zoomed."""

    name = "none"

    def scores(self, memory, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        return q.new_zeros(q.shape[0], memory.n_spans)  # (H_kv, N)


class StaticSemantic(SeKV):
    name = "static"
    budgeted = False  # its memory does not follow a budget (the bench runs it once)
    reads_books = False  # its attention has no bounded-position path

    def new_policy(self) -> ZoomPolicy:
        return ZoomPolicy(router=NoZoom(), budget=0, use_summaries=True)

    def read_tensors(self) -> list[torch.Tensor]:
        """What attention reads every step: sinks + anchors K/V, summaries, span lengths."""
        s = self.spans
        fixed = [*s.fixed[0].tensors(), *s.fixed[1].tensors()]
        return [*fixed, s.summary_k, s.summary_v, s.lengths, s.log_len]

    def memory(self) -> dict[str, int]:
        resident = sum(t.numel() * t.element_size() for t in self.read_tensors())
        fp16 = sum(
            t.numel() * (2 if t.is_floating_point() else t.element_size())
            for t in self.read_tensors()
        )
        return {
            "resident_bytes": resident,
            "resident_fp16_bytes": fp16,
            "resident_tier_bytes": resident,
            "zoom_peak_bytes": 0,
            "local_window_bytes": self.loaded.spec.kv_bytes(
                self.local_tokens, self.loaded.dtype.itemsize
            ),
            "offloaded_bytes": 0,  # the store's bases exist on disk but are never read
        }

    def routing(self) -> dict[str, Any]:
        if self.policy is None:
            return {}
        return {
            "router": "none",
            "summaries": True,
            "spans": self.spans.n_spans,
            "fixed_tokens": self.spans.fixed_tokens,
            "reconstructions": self.spans.reconstructions,
        }
