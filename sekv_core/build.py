"""One-shot build: a span store from one prefill of a context that fits the model window.

Prefill (K, V, surprisal, query moments) -> segmentation -> the span tokens' routing sketch rows
(resident); their pre-RoPE keys and values in the
document's code (offload tier, :mod:`sekv_core.codec`) -> the store's files, written
atomically. Contexts beyond the window are streamed instead (:mod:`sekv_core.stream`).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from .codec import fit_code
from .config import StoreSettings
from .documents import Document
from .format import (
    code_stats,
    nbytes,
    on_disk,
    quantize_fixed,
    store_manifest,
    tier_bytes,
    trace_tensors,
    write_atomically,
)
from .models import LoadedModel
from .packed import pack
from .prefill import Progress, prefill, release_freed_memory
from .prompt import Context
from .rans import compacted
from .rope import Rope
from .segment import SPAN, n_sinks, segment
from .sketch import quantize_sketch, sketch_basis, span_representatives
from .sketch_rebuild import SpanKeys, rebuilds, sketch_fixes
from .summary import STORE_DTYPE, one_thread


def build_store(
    path: Path,
    loaded: LoadedModel,
    document: Document,
    context: Context,
    settings: StoreSettings,
    progress: Progress | None = None,
) -> None:
    """Prefill, segment, factorise and write a store atomically at ``path``."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    pre = prefill(loaded.model, context.ids, settings.prefill_chunk, progress)
    timings["prefill_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    seg = segment(pre.surprisal, context.doc_start, settings.segment)
    starts, ends = torch.from_numpy(seg.starts), torch.from_numpy(seg.ends)
    lengths = ends - starts
    fixed = torch.from_numpy(np.flatnonzero(seg.roles != SPAN))  # sinks + anchors, ascending
    keys, values = pre.keys.float(), pre.values.float()  # (L, H, T, D) post-RoPE
    pre.keys = pre.values = None  # the rows below are the only copies kept
    fixed_k, fixed_v = keys[:, :, fixed].to(STORE_DTYPE), values[:, :, fixed].to(STORE_DTYPE)
    span_tokens = torch.from_numpy(np.flatnonzero(seg.roles == SPAN))  # spans in order
    span_keys = keys[:, :, span_tokens]
    v_rows = values[:, :, span_tokens]  # (L, H, S, D)
    del keys, values
    release_freed_memory()  # (each big free below too: the build's peak memory)
    with one_thread():
        basis = sketch_basis(span_keys, pre.query_moment, settings.sketch_dim)
        sketch = basis.project(span_keys)
    timings["segment_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    rope = Rope(loaded.model)  # codes of pre-RoPE keys: un-rotated in place, layer by layer
    k_rows = span_keys
    for i in range(k_rows.shape[0]):
        k_rows[i] = rope.unrotate(k_rows[i], span_tokens)
    k_code = fit_code(k_rows, settings.key_code, "store.key_code", pre.query_moment)
    v_code = fit_code(v_rows, settings.value_code, "store.value_code")
    offload = {"k_rows": k_code.encode(k_rows).flatten(), "v_rows": v_code.encode(v_rows).flatten()}
    del k_rows, v_rows
    release_freed_memory()
    timings["code_s"] = time.perf_counter() - t0

    quantized = quantize_sketch(sketch, settings.sketch_bits)
    resident = {
        "fixed_pos": fixed,
        "fixed_k": fixed_k,
        "fixed_v": fixed_v,
        "span_starts": starts,
        "span_ends": ends,
        "sketch_proj": basis.query_proj.to(STORE_DTYPE),
        "sketch_key": basis.key_proj.to(STORE_DTYPE),  # (rebuilds the rows at load)
        "sketch_mean": basis.mean.to(STORE_DTYPE),
        **quantized,
        "span_reps": span_representatives(torch.from_numpy(pre.surprisal)[span_tokens], lengths),
        **k_code.tensors("k"),
        **v_code.tensors("v"),
        "part_rows": torch.tensor([0, len(span_tokens)]),  # one part: every span token's row
    }
    quantize_fixed(resident)  # sinks and anchors as answers hold them: 8-bit rows
    t0 = time.perf_counter()
    if rebuilds(len(span_tokens)):  # then the store keeps fixes to the rows rebuilt at load
        s = settings
        resident.update(
            sketch_fixes(SpanKeys(resident, [offload["k_rows"]], s.key_code, rope, s.sketch_bits))
        )
    timings["sketch_fixes_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    offload_file = offload  # a long book's records as they are (a load would decode for seconds)
    if rebuilds(len(span_tokens)):
        offload_file = compacted(offload, resident["part_rows"], {"k": k_code, "v": v_code})
    timings["tier_coding_s"] = time.perf_counter() - t0
    trace = trace_tensors(document, context, pre.surprisal, seg.roles)
    positions = {
        "mode": "original",
        "sinks": n_sinks(len(context), context.doc_start, settings.segment),
    }
    manifest = store_manifest(loaded, document, context, settings, positions)
    manifest["bytes"].update(
        **tier_bytes(resident),
        offloaded=nbytes(offload_file),
        offload_records=nbytes(offload),
        trace=nbytes(trace),
    )
    manifest["stats"] = {**seg.stats(), **code_stats(k_code, v_code)}
    manifest["timings"] = {k: round(v, 4) for k, v in timings.items()}
    write_atomically(
        path,
        {
            "resident.safetensors": on_disk(resident, positions["sinks"]),
            "offload.safetensors": offload_file,
            "trace.safetensors": pack(trace),
        },
        manifest,
    )
