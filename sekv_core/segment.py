"""Entropy-guided segmentation: surprisal peaks cut the document into spans.

Every context token gets exactly one role:

- **sink**: the prompt head (system instructions) and the first ``sinks`` document tokens —
  always kept at full resolution (attention sinks);
- **anchor**: a boundary token whose surprisal is a peak (H > mu + alpha * sigma), kept at full
  resolution; at most ``anchor_cap`` of the document tokens;
- **span**: the runs of tokens between boundaries; a span's tokens are coded into the offload
  tier and sketched for routing, and zoomed (decoded) as a whole.

Raw peaks lie a few tokens apart, too close to make spans of, so boundaries are thinned: a peak
opens a new span only if the current span already holds ``min_len`` tokens; a span reaching
``max_len`` is cut at its highest-surprisal token in the last half (or at ``max_len``). Why
these lengths: docs/design.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import SegmentSettings

SINK, ANCHOR, SPAN = 0, 1, 2


@dataclass(frozen=True)
class Segmentation:
    """Roles of the context tokens and the spans' [start, end) token ranges (ascending)."""

    roles: np.ndarray  # (T,) int8: SINK / ANCHOR / SPAN
    starts: np.ndarray  # (N,) int64
    ends: np.ndarray  # (N,) int64, exclusive
    threshold: float  # the surprisal threshold mu + alpha * sigma (nats)

    @property
    def lengths(self) -> np.ndarray:
        return self.ends - self.starts

    @property
    def anchors(self) -> np.ndarray:
        return np.flatnonzero(self.roles == ANCHOR)

    @property
    def sinks(self) -> np.ndarray:
        return np.flatnonzero(self.roles == SINK)

    def without_spans(self) -> Segmentation:
        """The same context with every span token an anchor: no spans (a document too short
        for its spans' codes to pay keeps every token resident: :mod:`sekv_core.store.build`)."""
        roles = np.where(self.roles == SPAN, ANCHOR, self.roles).astype(np.int8)
        return Segmentation(roles, self.starts[:0], self.ends[:0], self.threshold)

    def span_of(self) -> np.ndarray:
        """(T,) span index of each token, -1 for sinks and anchors."""
        out = np.full(len(self.roles), -1, dtype=np.int64)
        for i, (s, e) in enumerate(zip(self.starts.tolist(), self.ends.tolist(), strict=True)):
            out[s:e] = i
        return out

    def stats(self) -> dict:
        doc = int((self.roles != SINK).sum()) or 1
        lengths = self.lengths
        return {
            "tokens": int(len(self.roles)),
            "sinks": int((self.roles == SINK).sum()),
            "anchors": int((self.roles == ANCHOR).sum()),
            "anchors_pct": round(100 * float((self.roles == ANCHOR).sum()) / doc, 2),
            "spans": int(len(lengths)),
            "span_len": {
                "min": int(lengths.min()) if len(lengths) else 0,
                "p50": float(np.median(lengths)) if len(lengths) else 0.0,
                "mean": round(float(lengths.mean()), 2) if len(lengths) else 0.0,
                "max": int(lengths.max()) if len(lengths) else 0,
            },
            "threshold_nats": round(self.threshold, 3),
        }


def segment(surprisal: np.ndarray, doc_start: int, settings: SegmentSettings) -> Segmentation:
    """Cut the context into sinks, anchors and spans.

    Parameters
    ----------
    surprisal : (T,) float array
        -log p(x_t | x_<t) of each context token (nats); entries before ``doc_start`` are ignored.
    doc_start : int
        Index of the first document token (tokens before it are the prompt head: sinks).
    """
    total = len(surprisal)
    roles = np.full(total, SPAN, dtype=np.int8)
    first = min(total, doc_start + settings.sinks)
    roles[:first] = SINK
    doc = np.asarray(surprisal[doc_start:], dtype=np.float64)
    threshold = float(doc.mean() + settings.alpha * doc.std()) if len(doc) else 0.0
    h = np.asarray(surprisal, dtype=np.float64)

    boundaries: list[int] = []  # tokens that open a new span
    span_start = first
    for t in np.flatnonzero(h[first:] > threshold) + first:  # ascending peaks
        while t - span_start > settings.max_len:  # forced cuts inside an over-long stretch
            span_start = forced_cut(h, span_start, settings)
            boundaries.append(span_start)
        if t - span_start >= settings.min_len and total - t >= settings.min_len // 2:
            boundaries.append(int(t))
            span_start = int(t)
    while total - span_start > settings.max_len:
        span_start = forced_cut(h, span_start, settings)
        boundaries.append(span_start)

    # the strongest peaks among the boundaries become anchors (capped)
    peaks = [b for b in boundaries if h[b] > threshold]
    cap = int(settings.anchor_cap * max(len(doc), 1))
    anchors = sorted(sorted(peaks, key=lambda b: -h[b])[:cap])
    roles[anchors] = ANCHOR

    cuts = sorted({first, *boundaries, total})
    starts, ends = [], []
    for s, e in zip(cuts[:-1], cuts[1:], strict=True):
        if roles[s] == ANCHOR:
            s += 1
        if e > s:
            starts.append(s)
            ends.append(e)
    return Segmentation(roles, np.array(starts, np.int64), np.array(ends, np.int64), threshold)


def forced_cut(h: np.ndarray, start: int, settings: SegmentSettings) -> int:
    """Where to cut a stretch that would exceed max_len: its surprisal peak in the last half."""
    lo, hi = start + settings.max_len // 2, start + settings.max_len
    return int(lo + np.argmax(h[lo : hi + 1]))


def span_cuts(
    h: np.ndarray,
    start: int,
    stop: int,
    threshold: float,
    settings: SegmentSettings,
    total: int,
    final: bool,
) -> list[int]:
    """Span openers from ``start`` as :func:`segment` places them.

    Only surprisal before ``stop`` is read; unless ``final`` (``stop`` = ``total``), the last
    opener starts a span that may still grow.
    """
    cuts, span_start = [start], start
    for t in np.flatnonzero(h[start:stop] > threshold) + start:  # ascending peaks
        while t - span_start > settings.max_len:
            span_start = forced_cut(h, span_start, settings)
            cuts.append(span_start)
        if t - span_start >= settings.min_len and total - t >= settings.min_len // 2:
            cuts.append(int(t))
            span_start = int(t)
    end = total if final else stop
    while end - span_start > settings.max_len:
        span_start = forced_cut(h, span_start, settings)
        cuts.append(span_start)
    return cuts


def n_sinks(context_tokens: int, doc_start: int, settings: SegmentSettings) -> int:
    """Sink tokens: the prompt head and the first ``settings.sinks`` document tokens."""
    return min(context_tokens, doc_start + settings.sinks)
