"""Streamed ingest: a span store built chunk by chunk, for documents beyond the model window.

Each chunk of ``prefill_chunk`` tokens runs through the model with the mixed-resolution attention
(:mod:`sekv_core.attention`): it attends to the sinks, the tokens not yet committed to the store
(at least ``stream.window`` of them, full resolution) and the spans zoomed from the store built so
far (sketch router, ``stream.budget`` tokens per layer and KV head, routed by
``stream.route_queries`` of the chunk's queries). Once more than ``window + chunk`` tokens wait,
the oldest are segmented with the rule of :func:`sekv_core.segment.segment` (threshold
mu + alpha sigma of the surprisal read so far; the last, unfinished span keeps waiting),
summarised, factorised and appended to the store as one *part* file. Held in memory: the
waiting tokens, the chunk, the zoom cache and the resident routing structures (sketch, tables);
anchors, summaries and bases go to disk. Once the store holds STREAM_PREFILTER_SPANS spans, a
chunk's router scores exactly only the spans whose representative tokens score best
(:meth:`~sekv_core.zoom.SpanMemory.candidates`): the time per chunk stays nearly flat.

Positions: a context beyond the window gets a *bounded* store (pre-RoPE keys everywhere) and
chunks see the layout of :mod:`sekv_core.zoom` — sinks at 0.., zoomed tokens packed before the
waiting tokens, which start at ``sinks + budget`` — so no RoPE distance reaches the window. A
context that fits (``stream.always``) keeps original positions throughout.

Resume: after a chunk (at most every ``checkpoint_s`` seconds) the builder's state (waiting K/V,
surprisal, roles, counters, part checksums) is written atomically beside the parts in
``stores/.partial-<key>/``. A rerun verifies it, replays the parts and continues; anything that
does not verify is discarded and the build restarts. The finished store is assembled from the
parts into the usual three files and renamed into place.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import math
import os
import shutil
import time
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .attention import LocalWindow, ZoomPolicy, sekv_attention
from .basis import BASIS_DTYPE, PackedBasis, factorize, gather_spans, one_thread, summarize
from .config import StoreSettings, exceeds_window
from .documents import Document
from .errors import SekvError
from .models import LoadedModel
from .prefill import Progress, token_nll
from .prompt import Context
from .rope import Rope
from .router import SketchRouter
from .format import (
    map_safetensors,
    nbytes,
    rank_stats,
    sha256,
    store_manifest,
    tier_bytes,
    trace_tensors,
    write_atomically,
)
from .segment import ANCHOR, SINK, SPAN, Segmentation, n_sinks, span_cuts
from .sketch import (
    QueryMoments,
    SketchBasis,
    dequantize_sketch,
    quantize_sketch,
    sketch_basis,
    span_representatives,
)
from .zoom import SpanMemory

CHECKPOINT_S = 30.0  # at most this long between checkpoints
# a chunk's router scores exactly only the best 64 spans per KV head by their representative
# tokens once the store holds 256 spans: the cost per chunk stays nearly flat
STREAM_PREFILTER_SPANS, STREAM_PREFILTER_KEEP = 256, 64
HEADROOM = 1.5  # a sketch scale that must grow takes this margin (requantisations stay rare)
OPEN_PARTS = 32  # part files kept open
OFFLOAD = ("k_coef", "k_basis", "v_coef", "v_basis")
TABLES = tuple(f"{kind}_{t}" for kind in "kv" for t in ("rank", "raw", "coef_off", "basis_off"))
# what a resumed build reads back from each part (not the bases, summaries or anchors' K/V)
REPLAYED = (*TABLES, "span_starts", "span_ends", "span_reps", "sketch", "sketch_scale")
REPLAYED += ("anchor_pos",)
STATE_VERSION = 2  # 2: query-weighted sketch (query moments, basis)


class Grow:
    """A tensor growing along dimension ``dim`` (capacity x1.5); ``value`` is its content."""

    def __init__(self, dim: int) -> None:
        self.dim, self.buf, self.n = dim, None, 0

    def extend(self, t: torch.Tensor) -> None:
        add = t.shape[self.dim]
        if self.buf is None or self.n + add > self.buf.shape[self.dim]:
            shape = list(t.shape)
            shape[self.dim] = max(self.n + add, int(1.5 * self.n), 16)
            buf = t.new_empty(shape)
            if self.buf is not None:
                buf.narrow(self.dim, 0, self.n).copy_(self.value)
            self.buf = buf
        self.buf.narrow(self.dim, self.n, add).copy_(t)
        self.n += add

    @property
    def value(self) -> torch.Tensor:
        return self.buf.narrow(self.dim, 0, self.n)


class PartialStore:
    """The spans committed so far, shaped as a :class:`~sekv_core.store.SpanStore` for
    :class:`~sekv_core.zoom.SpanMemory`: a growing resident dict, the offload tier in parts.

    Zoom reads go through ``os.pread`` (not memory maps: pages a map touched would stay in the
    process's resident set, part after part).
    """

    def __init__(self, manifest: dict[str, Any], resident: dict[str, torch.Tensor]) -> None:
        self.manifest, self.resident = manifest, resident
        self.paths: list[Path] = []
        self.bases: dict[str, list[int]] = {name: [] for name in OFFLOAD}
        self.totals = dict.fromkeys(OFFLOAD, 0)
        self._open: OrderedDict[int, tuple[int, dict[str, int]]] = OrderedDict()

    def add_part(self, path: Path, sizes: dict[str, int]) -> dict[str, int]:
        """Register a part file; returns the global offset of each of its flat buffers."""
        self.paths.append(path)
        base = dict(self.totals)
        for name in OFFLOAD:
            self.bases[name].append(base[name])
            self.totals[name] += sizes[name]
        return base

    def offload_slice(self, name: str, start: int, stop: int) -> torch.Tensor:
        if stop <= start:
            return torch.zeros(0, dtype=BASIS_DTYPE)
        part = bisect_right(self.bases[name], start) - 1
        fd, data = self._file(part)
        size = BASIS_DTYPE.itemsize
        raw = os.pread(
            fd, (stop - start) * size, data[name] + (start - self.bases[name][part]) * size
        )
        return torch.frombuffer(bytearray(raw), dtype=BASIS_DTYPE)

    def offload_ranges(self, name: str, starts: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
        """Elements [starts[i], stops[i]) for every i, one after another (a read per range)."""
        pairs = zip(starts.tolist(), stops.tolist(), strict=True)
        parts = [self.offload_slice(name, a, b) for a, b in pairs]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=BASIS_DTYPE)

    def _file(self, part: int) -> tuple[int, dict[str, int]]:
        """An open descriptor of a part and the byte offset of each offload buffer in it."""
        if part in self._open:
            self._open.move_to_end(part)
            return self._open[part]
        fd = os.open(self.paths[part], os.O_RDONLY)
        header_len = int.from_bytes(os.pread(fd, 8, 0), "little")
        header = json.loads(os.pread(fd, header_len, 8))
        data = {n: 8 + header_len + header[n]["data_offsets"][0] for n in OFFLOAD}
        self._open[part] = (fd, data)
        while len(self._open) > OPEN_PARTS:
            os.close(self._open.popitem(last=False)[1][0])
        return fd, data

    def close(self) -> None:
        for fd, _ in self._open.values():
            os.close(fd)
        self._open.clear()


class StreamBuilder:
    """Builds one store by streaming its context; see the module docstring."""

    def __init__(
        self,
        path: Path,
        loaded: LoadedModel,
        document: Document,
        context: Context,
        settings: StoreSettings,
        checkpoint_s: float = CHECKPOINT_S,
    ) -> None:
        self.path, self.loaded, self.document, self.context = path, loaded, document, context
        self.settings, self.checkpoint_s = settings, checkpoint_s
        self.work = path.with_name(f".partial-{path.name}")
        spec, stream = loaded.spec, settings.stream
        self.T, self.doc_start = len(context), context.doc_start
        self.n_sinks = n_sinks(len(context), context.doc_start, settings.segment)
        self.bounded = exceeds_window(loaded.spec.window, len(context))
        # bounded positions must fit the model window: small windows get smaller chunks/budget
        small = spec.window // 8 if self.bounded else max(settings.prefill_chunk, stream.budget)
        self.chunk, self.budget = min(settings.prefill_chunk, small), min(stream.budget, small)
        self.band_end = self.n_sinks + self.budget  # bounded: first position of waiting tokens
        room = spec.window - self.band_end - 2 * self.chunk - 1
        self.window = min(stream.window, room) if self.bounded else stream.window
        if self.window < max(self.chunk, settings.segment.max_len):
            raise SekvError(
                f"the model's {spec.window:,}-token window is too small to stream this document "
                f"(its prompt head takes {self.n_sinks} tokens); use a model with a longer window"
            )
        self.rope = Rope(loaded.model)
        self.device, self.dtype = loaded.device, loaded.dtype
        self.keep = self.dtype if self.dtype.itemsize <= 2 else BASIS_DTYPE  # resident precision
        self.ids = torch.tensor(context.ids, device=self.device)
        self.max_position = 0  # largest RoPE position a chunk used (tests: < window)
        self.peak_window_bytes = 0  # largest waiting K/V held (flat in the document's length)
        self.timings = {"forward_s": 0.0, "commit_s": 0.0, "checkpoint_s": 0.0}
        self.chunk_times: list[tuple[int, int, float]] = []  # (tokens done, tokens, seconds)
        self._fresh()

    # -- state ------------------------------------------------------------------------------

    def _fresh(self) -> None:
        L, H, D = self.loaded.spec.num_layers, self.loaded.spec.num_kv_heads, self.head_dim
        self.next, self.commit_end, self.anchors, self.threshold = 0, self.n_sinks, 0, 0.0
        self.pending_k = torch.zeros(L, H, 0, D, dtype=self.dtype, device=self.device)
        self.pending_v = torch.zeros_like(self.pending_k)
        self.sink_k, self.sink_v = self.pending_k, self.pending_v  # pre-RoPE, set by chunk 0
        self.surprisal = np.zeros(self.T, dtype=np.float32)
        self.roles = np.full(self.T, SPAN, dtype=np.int8)
        self.roles[: self.n_sinks] = SINK
        self.sketch_basis: SketchBasis | None = None  # fixed at the first commit
        self.moments = QueryMoments()  # the queries seen until then (the sketch's weighting)
        self.sketch_scale: torch.Tensor | None = None  # (L, H, R) float32, grows rarely
        self.grow = {name: Grow(2) for name in ("sketch", *TABLES)}
        self.grow.update(span_starts=Grow(0), span_ends=Grow(0), span_reps=Grow(0))
        self.part_files: list[dict[str, Any]] = []
        self.store = PartialStore(
            {
                "document": {"context_tokens": self.T},
                "positions": {"mode": self.mode, "sinks": self.n_sinks},
            },
            {},
        )
        self.memory: SpanMemory | None = None

    @property
    def head_dim(self) -> int:
        return self.loaded.spec.head_dim

    @property
    def mode(self) -> str:
        return "bounded" if self.bounded else "original"

    def _frame(
        self, keys_pre: torch.Tensor, start: int, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Keys as the store keeps fixed keys, summaries and sketch: pre-RoPE when bounded,
        else post-RoPE at their original positions (``positions``, or from ``start`` on)."""
        if self.bounded:
            return keys_pre
        if positions is None:
            positions = torch.arange(start, start + keys_pre.shape[2])
        return self.rope.rotate(keys_pre, positions)

    # -- the build --------------------------------------------------------------------------

    def run(self, progress: Progress | None = None, warn: Callable[[str], None] | None = None):
        """Build (or resume) and write the store at ``path``."""
        self.work.mkdir(parents=True, exist_ok=True)
        with _exclusive(self.work / "lock", self.document.path.name):
            try:
                self._run(progress, warn)
            finally:
                self.store.close()
        shutil.rmtree(self.work, ignore_errors=True)

    def _run(self, progress: Progress | None, warn: Callable[[str], None] | None) -> None:
        if self._resume(warn) and warn:
            warn(
                f"resuming the interrupted ingest of {self.document.path.name} at token "
                f"{self.next:,} of {self.T:,}"
            )
        if progress and self.next:
            progress(self.next, self.T)
        last_checkpoint = time.perf_counter()
        with sekv_attention(self.loaded.model):
            while self.next < self.T:
                t0 = time.perf_counter()
                self._step()
                seconds = time.perf_counter() - t0
                self.chunk_times.append((self.next, self.next - self._last, seconds))
                done = self.next == self.T
                if done or time.perf_counter() - last_checkpoint >= self.checkpoint_s:
                    self._checkpoint()
                    last_checkpoint = time.perf_counter()
                release_memory()
                if progress:
                    progress(self.next, self.T)
        self._finish()

    @torch.inference_mode()
    def _step(self) -> None:
        """One chunk: forward with the mixed attention, surprisal, then commit what is old."""
        a = self._last = self.next
        b = min(self.T, a + max(self.chunk, self.n_sinks if a == 0 else 0))
        t0 = time.perf_counter()
        shift = max(0, self.commit_end - self.band_end) if self.bounded else 0
        positions = torch.arange(a, b) - shift
        like = torch.zeros(1, device=self.device, dtype=self.dtype)
        waiting = torch.arange(self.commit_end, max(a, self.commit_end)) - shift  # none at first
        cos, sin = self.rope.tables(waiting, like)
        moments = self.moments if self.sketch_basis is None else None
        window = LocalWindow(self.pending_k, self.pending_v, cos, sin, moments=moments)
        memory, policy = None, None
        if a > 0:
            memory = self.memory
            memory.pool_end = self.commit_end - shift
            queries = self.settings.stream.route_queries
            policy = ZoomPolicy(
                SketchRouter(),
                budget=self.budget,
                route_queries=queries,
                track_mass=False,
                prefilter_spans=STREAM_PREFILTER_SPANS,
                prefilter_keep=STREAM_PREFILTER_KEEP,
            )
        self.max_position = max(self.max_position, int(positions[-1]))
        out = self.loaded.model(
            input_ids=self.ids[a:b][None],
            position_ids=positions[None].to(self.device),
            use_cache=False,
            sekv_memory=memory,
            sekv_policy=policy,
            sekv_window=window,
        )
        logits = out.logits[0]  # (c, V)
        nll = token_nll(logits[:-1], self.ids[a + 1 : b])
        self.surprisal[a + 1 : b] = nll.cpu().numpy()
        if b < self.T:  # the next chunk's first token, predicted by this chunk's last
            self.surprisal[b] = float(token_nll(logits[-1:], self.ids[b : b + 1])[0])
        keys = torch.stack([k for k, _ in window.captured])  # (L, H, c, D) post-RoPE
        values = torch.stack([v for _, v in window.captured])
        keys = self.rope.unrotate(keys, positions)
        self.pending_k = torch.cat([self.pending_k, keys], dim=2)
        self.pending_v = torch.cat([self.pending_v, values], dim=2)
        if a == 0:  # the prompt head + first document tokens become the sinks
            ns = self.n_sinks
            self.sink_k = self.pending_k[:, :, :ns].clone()  # not a view of the chunk
            self.sink_v = self.pending_v[:, :, :ns].clone()
            self.pending_k, self.pending_v = self.pending_k[:, :, ns:], self.pending_v[:, :, ns:]
            self._start_memory()
        self.next = b
        self.timings["forward_s"] += time.perf_counter() - t0
        held = (self.pending_k.numel() + self.pending_v.numel()) * self.pending_k.element_size()
        self.peak_window_bytes = max(self.peak_window_bytes, held)
        if b == self.T or b - self.commit_end >= self.window + self.chunk:
            t0 = time.perf_counter()
            self._commit(final=b == self.T)
            self.timings["commit_s"] += time.perf_counter() - t0

    def _start_memory(self) -> None:
        """The growing span memory: the sinks, no spans yet."""
        L, H, D = self.sink_k.shape[0], self.sink_k.shape[1], self.head_dim
        R, bits = self.settings.sketch_dim, self.settings.sketch_bits
        dev, keep = self.device, self.keep
        sinks = torch.arange(self.n_sinks)
        sink_k = self.sink_k if self.bounded else self.rope.rotate(self.sink_k, sinks)
        empty = torch.zeros(L, H, 0, D, dtype=keep, device=dev)
        self.store.resident.update(
            fixed_pos=sinks,
            fixed_k=sink_k.to(keep),
            fixed_v=self.sink_v.to(keep),
            summary_k=empty,
            summary_v=empty,
            sketch_proj=torch.zeros(L, H, D, R, dtype=keep, device=dev),
            sketch_mean=torch.zeros(L, H, D, dtype=keep, device=dev),
            sketch=torch.zeros(L, H, 0, R // 2 if bits == 4 else R, dtype=_sketch_dtype(bits)),
            sketch_scale=torch.ones(L, H, R, dtype=keep, device=dev),
            span_starts=torch.zeros(0, dtype=torch.int64),
            span_ends=torch.zeros(0, dtype=torch.int64),
            span_reps=torch.zeros(0, 4, dtype=torch.int64, device=dev),
            **{name: torch.zeros(L, H, 0, dtype=_table_dtype(name)) for name in TABLES},
        )
        self.store.resident["sketch"] = self.store.resident["sketch"].to(dev)
        # 16-bit zoom: what a chunk attends to is part of the store (answers may hold 8 bits)
        self.memory = SpanMemory(self.store, self.rope, dev, self.dtype, kv_bits=16)
        if self.sketch_basis is not None:
            self._place_sketch_basis()

    def _place_sketch_basis(self) -> None:
        """The sketch's query side on the device (routers read it from the resident tier)."""
        b, dev, keep = self.sketch_basis, self.device, self.keep
        self.store.resident["sketch_proj"] = b.query_proj.to(dev, keep)
        self.store.resident["sketch_mean"] = b.mean.to(dev, keep)

    def _commit(self, final: bool) -> None:
        """Commit the complete spans older than the window (all tokens when ``final``), part by
        part (the memory a commit needs stays bounded)."""
        while self._commit_part(final) and self.commit_end < self.T:
            pass

    def _commit_part(self, final: bool) -> bool:
        """Segment the oldest waiting tokens, write them as a part, append them to the memory.
        Returns whether anything was committed."""
        seg, c, b = self.settings.segment, self.commit_end, self.next
        doc = self.surprisal[self.doc_start : b].astype(np.float64)
        self.threshold = float(doc.mean() + seg.alpha * doc.std()) if len(doc) else 0.0
        limit = self.T if final else b - self.window
        # parts of at most two chunks; but a document that never left the window is committed
        # in one part, as the one-shot build segments and quantises it
        found = self._segment(final, min(limit, c + 2 * self.chunk) if self.part_files else limit)
        if found is None:
            return False
        spans, chosen, end = found
        if self.sketch_basis is None:  # the sketch's directions, from what waits
            whole = self._segment(final, limit) if final else None  # final: all span tokens
            rows = _rows(whole[0], c) if whole else torch.arange(b - c)
            keys = self._frame(self.pending_k[:, :, rows].float().cpu(), c, rows + c)
            with one_thread():
                moment = self.moments.moment()
                self.sketch_basis = sketch_basis(keys, moment, self.settings.sketch_dim)
            self._place_sketch_basis()
        self.roles[c:end] = SPAN
        self.roles[chosen] = ANCHOR
        part = self._part(c, end, spans, chosen)
        name = f"part-{len(self.part_files):05d}.safetensors"
        tmp = self.work / f".{name}.tmp"
        save_file(part, str(tmp))
        os.replace(tmp, self.work / name)
        self.part_files.append({"name": name, "sha256": sha256(self.work / name)})
        self._append(part, self.work / name)
        self.pending_k = self.pending_k[:, :, end - c :]
        self.pending_v = self.pending_v[:, :, end - c :]
        self.commit_end = end
        return True

    def _segment(self, final: bool, limit: int) -> tuple[list, list[int], int] | None:
        """Spans and anchors of the waiting tokens up to ``limit`` (the complete spans only):
        (spans [(start, end)], anchor positions, end of the last span), or None."""
        seg, c, h = self.settings.segment, self.commit_end, self.surprisal
        cuts = span_cuts(h, c, self.next, self.threshold, seg, self.T, final)
        ends = [e for e in ([*cuts[1:], self.T] if final else cuts[1:]) if e <= limit]
        if not ends or ends[-1] <= c:
            return None
        end = ends[-1]
        openers = cuts[: len(ends)]
        peaks = [o for o in openers if o > self.n_sinks and h[o] > self.threshold]
        allowed = int(seg.anchor_cap * max(end - self.doc_start, 1)) - self.anchors
        chosen = sorted(sorted(peaks, key=lambda o: -h[o])[: max(allowed, 0)])
        is_anchor = set(chosen)
        starts = [o + (o in is_anchor) for o in openers]
        spans = [(s, e) for s, e in zip(starts, ends, strict=True) if e > s]
        if not spans:  # only one-token spans behind anchors: keep them as spans (parts hold spans)
            chosen, spans = [], list(zip(openers, ends, strict=True))
        return spans, chosen, end

    def _part(
        self, c: int, end: int, spans: list[tuple[int, int]], anchors: list[int]
    ) -> dict[str, torch.Tensor]:
        """The tensors of tokens [c, end): bases, summaries, sketch, anchors (CPU)."""
        s = self.settings
        keys_pre = self.pending_k[:, :, : end - c].float().cpu()  # (L, H, n, D)
        values = self.pending_v[:, :, : end - c].float().cpu()
        framed = self._frame(keys_pre, c)
        starts = torch.tensor([a for a, _ in spans], dtype=torch.int64).reshape(-1)
        ends = torch.tensor([e for _, e in spans], dtype=torch.int64).reshape(-1)
        lengths = ends - starts
        k_blocks = gather_spans(keys_pre, starts - c, ends - c)  # (L, H, N, M, D)
        v_blocks = gather_spans(values, starts - c, ends - c)
        h = torch.from_numpy(self.surprisal[c:end].copy())[:, None]
        weights = gather_spans(h, starts - c, ends - c)[..., 0]
        summary_k, summary_v = summarize(k_blocks, v_blocks, weights, lengths)
        if not self.bounded:
            summary_k = self.rope.rotate(summary_k, (starts + ends - 1) // 2)
        rows = _rows(spans, c)
        span_keys = framed[:, :, rows]  # (L, H, S, D)
        quantized = quantize_sketch(self.sketch_basis.project(span_keys), s.sketch_bits)
        span_h = torch.from_numpy(self.surprisal[c:end].copy())[rows]  # part-local sketch rows
        with one_thread():
            kb = _factorize(k_blocks, lengths, s.key_energy)
            vb = _factorize(v_blocks, lengths, s.value_energy)
        rel = torch.tensor(anchors, dtype=torch.int64) - c
        return {
            "span_starts": starts,
            "span_ends": ends,
            "summary_k": summary_k.to(BASIS_DTYPE).contiguous(),
            "summary_v": summary_v.to(BASIS_DTYPE).contiguous(),
            "sketch": quantized["sketch"].contiguous(),
            "sketch_scale": quantized["sketch_scale"],
            "span_reps": span_representatives(span_h, lengths),
            "anchor_pos": rel + c,
            "anchor_k": framed[:, :, rel].to(BASIS_DTYPE).contiguous(),
            "anchor_v": values[:, :, rel].to(BASIS_DTYPE).contiguous(),
            **{k: v.contiguous() for k, v in kb.tables("k").items()},
            **{k: v.contiguous() for k, v in vb.tables("v").items()},
            "k_coef": kb.coef,
            "k_basis": kb.basis,
            "v_coef": vb.coef,
            "v_basis": vb.basis,
        }

    def _append(self, part: dict[str, Any], path: Path) -> None:
        """Add a part's spans to the growing memory (also replays parts on resume: then the
        offload buffers are given by their sizes)."""
        sizes = {n: part[n] if isinstance(part[n], int) else part[n].numel() for n in OFFLOAD}
        base = self.store.add_part(path, sizes)
        for kind in "kv":
            for table in ("coef_off", "basis_off"):
                name = f"{kind}_{table}"
                self.grow[name].extend(part[name] + base[f"{kind}_{table[:-4]}"])
            for table in ("rank", "raw"):
                self.grow[f"{kind}_{table}"].extend(part[f"{kind}_{table}"])
        self.grow["span_starts"].extend(part["span_starts"])
        self.grow["span_ends"].extend(part["span_ends"])
        self.anchors += int(part["anchor_pos"].numel())
        self._append_sketch(part["sketch"], part["sketch_scale"].float(), part)
        r = self.store.resident
        for name, g in self.grow.items():
            if g.buf is not None:
                r[name] = g.value
        r["sketch_scale"] = self.sketch_scale.to(self.device, self.keep)
        self.memory.refresh()

    def _append_sketch(self, packed: torch.Tensor, scale: torch.Tensor, part) -> None:
        """Requantise a part's sketch (own scale) to the store's one; grow the latter when a
        part exceeds it (by HEADROOM more, requantising what is stored: rare)."""
        bits, R = self.settings.sketch_bits, self.settings.sketch_dim
        if self.sketch_scale is None:
            self.sketch_scale = scale
        elif (scale > self.sketch_scale).any():
            grown = torch.where(scale > self.sketch_scale, scale * HEADROOM, self.sketch_scale)
            grown = grown.to(BASIS_DTYPE).float()  # representable as stored
            ratio = (self.sketch_scale / grown).to(self.device)  # (L, H, R) <= 1
            g = self.grow["sketch"]
            if g.buf is not None:  # only the (layer, head) pairs whose scale grew
                layer, head = torch.nonzero((ratio < 1).any(dim=-1), as_tuple=True)
                levels = dequantize_sketch(g.value[layer, head], R, torch.float32)  # (n, S, R)
                again = _requantize(levels[None], ratio[layer, head][None], bits)[0]
                g.value[layer, head] = _pack(again, bits)
            self.sketch_scale = grown
        levels = dequantize_sketch(packed, R, torch.float32)
        levels = _requantize(levels, scale / self.sketch_scale, bits)
        rows = self.grow["sketch"].n
        self.grow["sketch"].extend(_pack(levels, bits).to(self.device))  # the resident device
        self.grow["span_reps"].extend((part["span_reps"] + rows).to(self.device))

    # -- checkpoints ------------------------------------------------------------------------

    def _checkpoint(self) -> None:
        """Write the state that lets a rerun continue after the last chunk (atomically)."""
        t0 = time.perf_counter()
        generation = int(time.time() * 1000)
        name = f"state-{generation}.safetensors"
        tensors = {
            "pending_k": self.pending_k.cpu(),
            "pending_v": self.pending_v.cpu(),
            "sink_k": self.sink_k.cpu(),
            "sink_v": self.sink_v.cpu(),
            "surprisal": torch.from_numpy(self.surprisal),
            "roles": torch.from_numpy(self.roles),
        }
        if self.sketch_basis is not None:
            b = self.sketch_basis
            tensors.update(sketch_query=b.query_proj, sketch_key=b.key_proj, sketch_mean=b.mean)
        else:
            tensors.update(self.moments.state())
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.work / name))
        state = {
            "version": STATE_VERSION,
            "store": self.path.name,
            "next": self.next,
            "commit_end": self.commit_end,
            "threshold": self.threshold,
            "parts": self.part_files,
            "tensors": {"name": name, "sha256": sha256(self.work / name)},
        }
        tmp = self.work / "state.json.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.work / "state.json")
        for old in self.work.glob("state-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)
        self.timings["checkpoint_s"] += time.perf_counter() - t0

    def _resume(self, warn: Callable[[str], None] | None) -> bool:
        """Continue from a verified checkpoint; discard the work directory otherwise."""
        file = self.work / "state.json"
        if not file.exists():
            self._clean()
            return False
        try:
            state = json.loads(file.read_text())
            ok = state.get("version") == STATE_VERSION and state.get("store") == self.path.name
            files = [*state["parts"], state["tensors"]]
            ok = ok and all(sha256(self.work / f["name"]) == f["sha256"] for f in files)
            if not ok:
                raise ValueError("checkpoint does not match")
            tensors = load_file(self.work / state["tensors"]["name"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if warn:
                warn(f"restarting the ingest of {self.document.path.name}: {exc}")
            self._clean()
            return False
        except Exception as exc:  # safetensors raises its own errors on a damaged file
            if warn:
                warn(f"restarting the ingest of {self.document.path.name}: {exc}")
            self._clean()
            return False
        self.next, self.commit_end = state["next"], state["commit_end"]
        self.threshold = state["threshold"]
        self.pending_k = tensors["pending_k"].to(self.device)
        self.pending_v = tensors["pending_v"].to(self.device)
        self.sink_k = tensors["sink_k"].to(self.device)
        self.sink_v = tensors["sink_v"].to(self.device)
        self.surprisal = tensors["surprisal"].numpy().copy()
        self.roles = tensors["roles"].numpy().copy()
        if "sketch_query" in tensors:
            t = tensors
            self.sketch_basis = SketchBasis(t["sketch_query"], t["sketch_key"], t["sketch_mean"])
        else:
            self.moments = QueryMoments.from_state(tensors)
        if self.next > 0:
            self._start_memory()
        for meta in state["parts"]:
            self.part_files.append(meta)
            path = self.work / meta["name"]
            self._append(_read(path, REPLAYED, OFFLOAD), path)
        return True

    def _clean(self) -> None:
        """Start over: drop parts and checkpoints (not the lock this process holds)."""
        for file in self.work.iterdir():
            if file.name != "lock":
                file.unlink(missing_ok=True)
        self._fresh()

    # -- the finished store -----------------------------------------------------------------

    def _finish(self) -> None:
        """Assemble the parts into the store's three files; write them atomically."""
        pieces: dict[str, list[torch.Tensor]] = {
            n: [] for n in ("anchor_pos", "anchor_k", "anchor_v", "summary_k", "summary_v")
        }
        for meta in self.part_files:
            part = _read(self.work / meta["name"], tuple(pieces))
            for name in pieces:
                pieces[name].append(part[name])
        sinks = torch.arange(self.n_sinks)
        sink_k = self._frame(self.sink_k.float().cpu(), 0)
        L, H, D = sink_k.shape[0], sink_k.shape[1], self.head_dim
        empty = torch.zeros(L, H, 0, D, dtype=BASIS_DTYPE)
        r = {name: self.store.resident[name].cpu() for name in self.grow}  # (empty: no parts)
        resident = {
            "fixed_pos": torch.cat([sinks, *pieces["anchor_pos"]]),
            "fixed_k": torch.cat([sink_k.to(BASIS_DTYPE), *pieces["anchor_k"]], 2),
            "fixed_v": torch.cat([self.sink_v.cpu().to(BASIS_DTYPE), *pieces["anchor_v"]], 2),
            "summary_k": torch.cat([empty, *pieces["summary_k"]], 2),
            "summary_v": torch.cat([empty, *pieces["summary_v"]], 2),
            "sketch_proj": self.store.resident["sketch_proj"].cpu().to(BASIS_DTYPE),
            "sketch_mean": self.store.resident["sketch_mean"].cpu().to(BASIS_DTYPE),
            "sketch_scale": self.store.resident["sketch_scale"].cpu().to(BASIS_DTYPE),
            **r,
        }
        resident["k_raw"] = resident["k_raw"].to(torch.uint8)
        resident["v_raw"] = resident["v_raw"].to(torch.uint8)
        trace = trace_tensors(self.document, self.context, self.surprisal, self.roles)
        manifest = store_manifest(
            self.loaded,
            self.document,
            self.context,
            self.settings,
            {"mode": self.mode, "sinks": self.n_sinks},
        )
        offloaded = sum(self.store.totals.values()) * BASIS_DTYPE.itemsize
        manifest["bytes"].update(**tier_bytes(resident), offloaded=offloaded, trace=nbytes(trace))
        seg = Segmentation(
            self.roles, r["span_starts"].numpy(), r["span_ends"].numpy(), self.threshold
        )
        manifest["stats"] = {
            **seg.stats(),
            **rank_stats(r["k_rank"], r["k_raw"].bool(), r["v_rank"], r["v_raw"].bool()),
        }
        manifest["timings"] = {k: round(v, 4) for k, v in self.timings.items()}
        manifest["stream"] = self.report()
        write_atomically(
            self.path,
            {"resident.safetensors": resident, "trace.safetensors": trace},
            manifest,
            writers={"offload.safetensors": self._write_offload},
        )

    def _write_offload(self, out: Path) -> None:
        """offload.safetensors: every part's flat buffers, concatenated in part order."""
        header, offset = {}, 0
        for name in OFFLOAD:
            size = self.store.totals[name] * BASIS_DTYPE.itemsize
            count, span = self.store.totals[name], [offset, offset + size]
            header[name] = {"dtype": "F16", "shape": [count], "data_offsets": span}
            offset += size
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name in OFFLOAD:
                for path in self.store.paths:
                    f.write(map_safetensors(path, (name,))[name].numpy().tobytes())

    def report(self) -> dict[str, Any]:
        """What the stream did: window, positions, speed, memory held (for the manifest)."""
        at = {}  # tokens/s over the tenth of the document before each mark (chunk + commit)
        for share in (0.1, 0.5, 1.0):
            lo, hi = (share - 0.1) * self.T, share * self.T
            rows = [(n, s) for done, n, s in self.chunk_times if lo < done <= hi]
            if rows:
                tokens, seconds = sum(n for n, _ in rows), sum(s for _, s in rows)
                at[f"{int(share * 100)}%"] = round(tokens / seconds, 1)
        return {
            "window": self.window,
            "chunk": self.chunk,
            "budget": self.budget,
            "positions": self.mode,
            "max_position": self.max_position,
            "parts": len(self.part_files),
            "peak_window_bytes": self.peak_window_bytes,
            "memory_resident_bytes": self.memory.resident_bytes() if self.memory else 0,
            "tokens_per_s_at": at,
        }


def _factorize(blocks: torch.Tensor, lengths: torch.Tensor, energy: float) -> PackedBasis:
    """:func:`~sekv_core.basis.factorize` of a chunk's few spans, all layers in one solve (its
    per-layer loop bounds the memory of a whole document; a chunk is small). Same result."""
    L, H = blocks.shape[:2]
    packed = factorize(blocks.reshape(1, L * H, *blocks.shape[2:]), lengths, energy)
    for name in ("rank", "raw", "coef_off", "basis_off"):  # (1, L*H, N) -> (L, H, N)
        setattr(packed, name, getattr(packed, name).reshape(L, H, -1))
    return packed


def _rows(spans: list[tuple[int, int]], c: int) -> torch.Tensor:
    """Indices (relative to ``c``) of the tokens of ``spans``, in order."""
    if not spans:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(a, e) for a, e in spans]) - c


def _read(path: Path, names: tuple[str, ...], sizes: tuple[str, ...] = ()) -> dict[str, Any]:
    """Tensors ``names`` of a safetensors file (only those are read), and the element counts
    of ``sizes``."""
    with safe_open(str(path), framework="pt") as f:
        out: dict[str, Any] = {name: f.get_tensor(name) for name in names}
        for name in sizes:
            out[name] = math.prod(f.get_slice(name).get_shape())
    return out


def release_memory() -> None:
    """Give freed heap memory back to the system (glibc): a long ingest frees buffers of many
    sizes, and without this the resident set keeps what fragmentation leaves behind."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@contextmanager
def _exclusive(path: Path, name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path``: one process builds a given store at a time."""
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise SekvError(
                f"another sekv process is ingesting {name!r}; wait for it to finish"
            ) from None
        yield


def _requantize(levels: torch.Tensor, ratio: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer levels (L, H, S, R) rescaled by ``ratio`` (L, H, R) and rounded."""
    top = 2 ** (bits - 1) - 1
    return (levels * ratio[:, :, None]).round().clamp(-top, top)


def _pack(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer levels (..., R) in [-7, 7] / [-127, 127] -> the sketch's stored form."""
    if bits == 8:
        return levels.to(torch.int8)
    u = (levels + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _sketch_dtype(bits: int) -> torch.dtype:
    return torch.int8 if bits == 8 else torch.uint8


def _table_dtype(name: str) -> torch.dtype:
    if name.endswith("_raw"):
        return torch.uint8
    return torch.int32 if name.endswith("_rank") else torch.int64


def build_streamed(
    path: Path,
    loaded: LoadedModel,
    document: Document,
    context: Context,
    settings: StoreSettings,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
    checkpoint_s: float | None = None,
) -> dict[str, Any]:
    """Stream ``context`` into a store at ``path`` (resuming an interrupted build); returns the
    builder's report (also in the manifest under ``stream``). Checkpoints at most every
    ``checkpoint_s`` seconds (default CHECKPOINT_S)."""
    checkpoint_s = CHECKPOINT_S if checkpoint_s is None else checkpoint_s
    builder = StreamBuilder(path, loaded, document, context, settings, checkpoint_s)
    builder.run(progress, warn)
    return builder.report()
