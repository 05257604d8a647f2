"""One-shot build: a span store from one prefill of a context that fits the model window.

Prefill (K, V, surprisal, query moments) -> segmentation (a document too short for its spans
to pay for their codes' and sketch's tables keeps every token resident) -> the sketch's
directions and scale -> the span tokens' pre-RoPE keys and values in the offload codes ->
:func:`write_store`.
Contexts beyond the window are streamed instead (:mod:`sekv_core.store.stream`).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from ..prefill import Progress, prefill, release_freed_memory
from ..rope import Rope
from ..segment import SPAN, n_sinks, segment
from ..sketch import quantize_sketch, sketch_basis, span_representatives
from ..threads import one_thread
from .codes import fit_code
from .format import StoreSource, spans_pay, trace_tensors
from .resident import SpanTables
from .write import BuiltStore, write_store


def build_store(path: Path, source: StoreSource, progress: Progress | None = None) -> None:
    """Prefill, segment, code and write the store of ``source`` atomically at ``path``."""
    loaded, context, settings = source.loaded, source.context, source.settings
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    pre = prefill(loaded.model, context.ids, settings.prefill_chunk, progress)
    timings["prefill_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    seg = segment(pre.surprisal, context.doc_start, settings.segment)
    if not spans_pay(loaded.spec, settings, int((seg.roles == SPAN).sum())):
        seg = seg.without_spans()  # a short document: every token resident
    starts, ends = torch.from_numpy(seg.starts), torch.from_numpy(seg.ends)
    fixed = torch.from_numpy(np.flatnonzero(seg.roles != SPAN))  # sinks + anchors, ascending
    span_tokens = torch.from_numpy(np.flatnonzero(seg.roles == SPAN))  # spans in order
    keys, values = pre.keys.float(), pre.values.float()  # (L, H, T, D) post-RoPE
    pre.keys = pre.values = None  # the rows below are the only copies kept
    fixed_k, fixed_v = keys[:, :, fixed], values[:, :, fixed]
    k_rows, v_rows = keys[:, :, span_tokens], values[:, :, span_tokens]  # (L, H, S, D)
    del keys, values
    release_freed_memory()  # (each big free below too: the build's peak memory)
    with one_thread():
        basis = sketch_basis(k_rows, pre.query_moment, settings.sketch_dim)
        scale = quantize_sketch(basis.project(k_rows), settings.sketch_bits)["sketch_scale"]
    rope = Rope(loaded.model)  # the offload tier holds pre-RoPE keys: un-rotated in place
    for i in range(k_rows.shape[0]):
        k_rows[i] = rope.unrotate(k_rows[i], span_tokens)
    codes = {
        "k": fit_code(k_rows, settings.key_code, "store.key_code", pre.query_moment),
        "v": fit_code(v_rows, settings.value_code, "store.value_code"),
    }
    records = {"k": codes["k"].encode(k_rows), "v": codes["v"].encode(v_rows)}
    del k_rows, v_rows
    release_freed_memory()
    timings["code_s"] = time.perf_counter() - t0

    tables = SpanTables(
        fixed_pos=fixed,
        fixed_k=fixed_k,
        fixed_v=fixed_v,
        span_starts=starts,
        span_ends=ends,
        span_reps=span_representatives(torch.from_numpy(pre.surprisal)[span_tokens], ends - starts),
        sketch_proj=basis.query_proj,
        sketch_key=basis.key_proj,
        sketch_mean=basis.mean,
        sketch_scale=scale,
    )
    sinks = n_sinks(len(context), context.doc_start, settings.segment)
    positions = {"mode": "original", "sinks": sinks}
    trace = trace_tensors(source.document, context, pre.surprisal, seg.roles)
    report = {"stats": seg.stats(), "timings": {k: round(v, 4) for k, v in timings.items()}}
    write_store(path, source, BuiltStore(positions, tables, codes, records, trace, report))
