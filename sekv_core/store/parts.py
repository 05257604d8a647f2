"""A streamed build's parts: what it commits of its waiting tokens, segmented and coded.

A streamed build (:mod:`sekv_core.store.stream`) commits its oldest waiting tokens as *parts*: their
spans and anchors (:func:`part_spans`: the segmentation rule, with the threshold read so far) and
their tensors (:func:`part_tensors`: coded K/V records, sketch rows, anchors' K/V); the sketch's
directions and the offload code are fitted once, to what waits at the first commit
(:func:`waiting_sketch_basis`, :func:`waiting_codebooks`). Where parts are kept and the build's
state between chunks: :mod:`sekv_core.store.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..config import SegmentSettings, StoreSettings
from ..segment import span_cuts
from ..sketch import SketchBasis, quantize_sketch, sketch_basis, span_representatives
from ..summary import STORE_DTYPE, one_thread
from .checkpoint import StreamState
from .codes import Code, fit_code


def part_spans(
    state: StreamState,
    final: bool,
    limit: int,
    seg: SegmentSettings,
    sinks: int,
    doc_start: int,
    anchors: int,
) -> tuple[list[tuple[int, int]], list[int], int] | None:
    """Spans and anchors of the waiting tokens up to ``limit`` (the complete spans only; the last
    one too when ``final``): (spans [(start, end)], anchor positions, end of the last span), or
    None. ``anchors``: how many are committed already (the document's anchor cap)."""
    c, h, T = state.commit_end, state.surprisal, len(state.surprisal)
    cuts = span_cuts(h, c, state.next, state.threshold, seg, T, final)
    ends = [e for e in ([*cuts[1:], T] if final else cuts[1:]) if e <= limit]
    if not ends or ends[-1] <= c:
        return None
    end = ends[-1]
    openers = cuts[: len(ends)]
    peaks = [o for o in openers if o > sinks and h[o] > state.threshold]
    allowed = int(seg.anchor_cap * max(end - doc_start, 1)) - anchors
    chosen = sorted(sorted(peaks, key=lambda o: -h[o])[: max(allowed, 0)])
    is_anchor = set(chosen)
    starts = [o + (o in is_anchor) for o in openers]
    spans = [(s, e) for s, e in zip(starts, ends, strict=True) if e > s]
    if not spans:  # only one-token spans behind anchors: keep them as spans (parts hold spans)
        chosen, spans = [], list(zip(openers, ends, strict=True))
    return spans, chosen, end


def waiting_sketch_basis(
    state: StreamState,
    spans: list[tuple[int, int]] | None,
    frame: Callable[..., torch.Tensor],
    dim: int,
) -> SketchBasis:
    """The sketch's directions (fixed at the first commit) from the waiting tokens' keys: those
    of ``spans`` (None: all waiting tokens), weighted by the queries seen so far."""
    c = state.commit_end
    rows = span_rows(spans, c) if spans is not None else torch.arange(state.next - c)
    keys = frame(state.pending_k[:, :, rows].float().cpu(), c, rows + c)
    with one_thread():
        moment = state.moments.moment()
        return sketch_basis(keys, moment, dim)


def waiting_codebooks(
    state: StreamState, spans: list[tuple[int, int]] | None, settings: StoreSettings
) -> dict[str, torch.Tensor]:
    """The offload code's codebook tensors (fixed at the first commit) from the waiting tokens'
    keys (pre-RoPE) and values: those of ``spans`` (None: all waiting tokens)."""
    c = state.commit_end
    rows = span_rows(spans, c) if spans is not None else torch.arange(state.next - c)
    keys = state.pending_k[:, :, rows].float().cpu()
    values = state.pending_v[:, :, rows].float().cpu()
    with one_thread():
        k = fit_code(keys, settings.key_code, "store.key_code", state.moments.moment())
        v = fit_code(values, settings.value_code, "store.value_code")
    return {**k.tensors("k"), **v.tensors("v")}


def part_tensors(
    keys_pre: torch.Tensor,
    values: torch.Tensor,
    surprisal: np.ndarray,
    start: int,
    spans: list[tuple[int, int]],
    anchors: list[int],
    basis: SketchBasis,
    codes: dict[str, Code],
    settings: StoreSettings,
    frame: Callable[..., torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The tensors of a part: coded K/V records, sketch, anchors (CPU).

    keys_pre, values : (L, H, n, D) float32, K (pre-RoPE) and V of tokens [start, start + n);
    surprisal : (n,) theirs; spans [(start, end)] and anchors : document positions; basis : the
    sketch's projections; codes : the offload code's codebooks ("k", "v");
    frame(keys, start, positions=None) : keys as the store keeps them
    (:meth:`sekv_core.store.layout.StreamLayout.frame`).
    """
    c, s = start, settings
    framed = frame(keys_pre, c)
    starts = torch.tensor([a for a, _ in spans], dtype=torch.int64).reshape(-1)
    ends = torch.tensor([e for _, e in spans], dtype=torch.int64).reshape(-1)
    lengths = ends - starts
    rows = span_rows(spans, c)
    span_keys = framed[:, :, rows]  # (L, H, S, D)
    quantized = quantize_sketch(basis.project(span_keys), s.sketch_bits)
    span_h = torch.from_numpy(surprisal.copy())[rows]  # part-local sketch rows
    rel = torch.tensor(anchors, dtype=torch.int64) - c
    return {
        "span_starts": starts,
        "span_ends": ends,
        "sketch": quantized["sketch"].contiguous(),
        "sketch_scale": quantized["sketch_scale"],
        "span_reps": span_representatives(span_h, lengths),
        "anchor_pos": rel + c,
        "anchor_k": framed[:, :, rel].to(STORE_DTYPE).contiguous(),
        "anchor_v": values[:, :, rel].to(STORE_DTYPE).contiguous(),
        "k_rows": codes["k"].encode(keys_pre[:, :, rows]).flatten(),
        "v_rows": codes["v"].encode(values[:, :, rows]).flatten(),
    }


def span_rows(spans: list[tuple[int, int]], c: int) -> torch.Tensor:
    """Indices (relative to ``c``) of the tokens of ``spans``, in order."""
    if not spans:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(a, e) for a, e in spans]) - c
