"""Streamed ingest: a span store built chunk by chunk, for books (documents beyond the reading
window, :func:`~sekv_core.config.is_book`).

Each chunk of ``prefill_chunk`` tokens is read by the caller's :class:`ChunkReader` (the zoom's):
it attends to the sinks, the tokens not committed yet (at least ``stream.window`` of them, at
full resolution) and the spans zoomed from the store grown so far (``stream.budget`` tokens per
layer and KV head, routed by ``stream.route_queries`` of its queries). Once more than ``window +
chunk`` tokens wait, the oldest complete spans are committed as one *part*: segmented by the rule
of :func:`sekv_core.segment.segment` on the surprisal read so far, coded, written to a file of
its own and appended to the growing store (:mod:`.partial`). Memory holds the waiting tokens,
the chunk, the zoom cache and the resident routing tier; the records stay in the part files.

Positions (:class:`StreamLayout`): a book's store is *bounded* (pre-RoPE keys, no anchors) and
its chunks see a bounded span memory's layout (sinks at 0.., zoomed tokens packed before the
waiting tokens, which start at ``sinks + budget``), so no RoPE distance reaches the reading
window. A context that fits (``stream.always``) keeps original positions and anchors.

Resume: the part files and, at most every :data:`CHECKPOINT_S` seconds, the stream's state
(:mod:`.checkpoint`) are kept in ``stores/.partial-<key>/``; a rerun replays a checkpoint that
verifies whole and starts over otherwise. The finished store is written from the parts by
:func:`~.write.write_store`.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ..config import is_book, reading_window
from ..errors import SekvError
from ..kvquant import STORE_DTYPE, resident_dtype
from ..models import LoadedModel
from ..paths import private_dir
from ..prefill import Progress, release_freed_memory
from ..rope import Rope
from ..segment import ANCHOR, SPAN, Segmentation, n_sinks, span_cuts
from ..sketch import QueryMoments, quantize_sketch, sketch_basis, span_representatives
from ..surprisal import Surprisal
from ..threads import one_thread
from .checkpoint import CheckpointInvalid, Checkpoints, StreamState
from .codes import fit_code
from .format import StoreSource, trace_tensors
from .partial import PartialStore
from .write import BuiltStore, write_store

CHECKPOINT_S = 30.0  # at most this long between checkpoints


class ChunkReader(Protocol):
    """What runs a stream's chunks through the model, attending to the store grown so far."""

    def attending(self) -> AbstractContextManager[None]: ...  # the block read() runs in

    def start(self, store: PartialStore) -> None: ...  # read store (sinks, no spans) from now on

    def refresh(self) -> None: ...  # the store gained a part

    def read(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        window: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        moments: QueryMoments | None,
        pool_end: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One chunk (``ids``, ``positions``: (c,)) after the waiting tokens ``window`` (keys
        pre-RoPE, values: (L, H, W, D); RoPE cos, sin: (W, D)); ``pool_end``: the first local
        position, None for the first chunk. Returns the last hidden states (c, hidden) and the
        chunk's post-RoPE keys and values (L, H, c, D)."""
        ...

    def resident_bytes(self) -> int: ...  # bytes held on the device for the store


# makes a stream's reader: (model, its RoPE frame, zoom budget, routing queries)
ChunkReaders = Callable[[LoadedModel, Rope, int, int], ChunkReader]


@dataclass(frozen=True)
class StreamLayout:
    """The sizes and positions of one stream (module docstring, "Positions")."""

    sinks: int  # prompt head + first document tokens
    chunk: int  # tokens per forward
    budget: int  # zoomed tokens per (layer, KV head)
    window: int  # tokens kept waiting at full resolution (at least)
    bounded: bool  # a book's store: pre-RoPE, chunks within the reading window
    rope: Rope
    band_end: int  # bounded: the first position of the waiting tokens (sinks + budget)

    @classmethod
    def plan(cls, source: StoreSource) -> StreamLayout:
        """The layout of streaming ``source``'s context; SekvError when the model window is
        too small."""
        spec, context, settings = source.loaded.spec, source.context, source.settings
        stream = settings.stream
        sinks = n_sinks(len(context), context.doc_start, settings.segment)
        bounded = is_book(spec.window, len(context))
        # bounded positions fit the reading window: small windows get smaller chunks/budget
        reads = reading_window(spec.window)
        small = reads // 8 if bounded else max(settings.prefill_chunk, stream.budget)
        chunk, budget = min(settings.prefill_chunk, small), min(stream.budget, small)
        room = reads - (sinks + budget) - 2 * chunk - 1
        window = min(stream.window, room) if bounded else stream.window
        if window < max(chunk, settings.segment.max_len):
            raise SekvError(
                f"the model's {spec.window:,}-token window is too small to stream this document "
                f"(its prompt head takes {sinks} tokens); use a model with a longer window"
            )
        rope = Rope(source.loaded.model)
        return cls(sinks, chunk, budget, window, bounded, rope, sinks + budget)

    @property
    def positions(self) -> dict[str, Any]:
        """The manifest's ``positions``: their ``mode`` and the ``sinks``."""
        return {"mode": "bounded" if self.bounded else "original", "sinks": self.sinks}

    def frame(self, keys_pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys as the store keeps fixed keys and the sketch: pre-RoPE when bounded, else
        post-RoPE at their original ``positions``."""
        return keys_pre if self.bounded else self.rope.rotate(keys_pre, positions)


class StreamBuilder:
    """Builds one store by streaming its context; see the module docstring."""

    def __init__(self, path: Path, source: StoreSource, readers: ChunkReaders) -> None:
        self.path, self.source, self.readers = path, source, readers
        self.loaded, self.document, self.settings = source.loaded, source.document, source.settings
        self.work = path.with_name(f".partial-{path.name}")
        self.checkpoints = Checkpoints(self.work, path.name, os.path.abspath(self.document.path))
        self.T, self.doc_start = len(source.context), source.context.doc_start
        self.layout = StreamLayout.plan(source)
        # no anchors in a book: bounded positions would put them all at one place
        segment = self.settings.segment
        self.segment = replace(segment, anchor_cap=0.0) if self.layout.bounded else segment
        self.device, self.dtype = self.loaded.device, self.loaded.dtype
        self.keep = resident_dtype(self.dtype)
        self.ids = torch.tensor(source.context.ids, device=self.device)
        self.nll = Surprisal(self.loaded.model.get_output_embeddings())
        self.max_position = 0  # largest RoPE position a chunk used (tests: < window)
        self.peak_window_bytes = 0  # largest waiting K/V held (flat in the document's length)
        self.timings = {"forward_s": 0.0, "commit_s": 0.0, "checkpoint_s": 0.0}
        self.chunk_times: list[tuple[int, int, float]] = []  # (tokens done, tokens, seconds)
        # before the first chunk: nothing read, nothing committed
        spec, lay = self.loaded.spec, self.layout
        shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.state = StreamState.start(self.T, lay.sinks, shape, self.dtype, self.device)
        manifest = {  # what the zoom memory reads of it
            "document": {"context_tokens": self.T},
            "positions": lay.positions,
        }
        self.store = PartialStore(self.work, manifest, self.settings, self.device, self.keep)
        budget, queries = lay.budget, self.settings.stream.route_queries
        self.reader = self.readers(self.loaded, lay.rope, budget, queries)

    def run(
        self, progress: Progress | None = None, warn: Callable[[str], None] | None = None
    ) -> None:
        """Build (or resume) and write the store at ``path``; the work directory is removed
        once it is written."""
        private_dir(self.work)  # its parts hold the document
        try:
            self._run(progress, warn)
        finally:
            self.store.close()
        shutil.rmtree(self.work, ignore_errors=True)

    def _run(self, progress: Progress | None, warn: Callable[[str], None] | None) -> None:
        if self._resume(warn) and warn:
            warn(
                f"resuming the interrupted ingest of {self.document.path.name} at token "
                f"{self.state.next:,} of {self.T:,}"
            )
        if progress and self.state.next:
            progress(self.state.next, self.T)
        last_checkpoint = time.perf_counter()
        with self.reader.attending():
            while self.state.next < self.T:
                t0 = time.perf_counter()
                self._step()
                seconds = time.perf_counter() - t0
                self.chunk_times.append((self.state.next, self.state.next - self._last, seconds))
                done = self.state.next == self.T
                if done or time.perf_counter() - last_checkpoint >= CHECKPOINT_S:
                    t0 = time.perf_counter()
                    self.checkpoints.write(self.state, self.store.tier.files)
                    self.timings["checkpoint_s"] += time.perf_counter() - t0
                    last_checkpoint = time.perf_counter()
                release_freed_memory()
                if progress:
                    progress(self.state.next, self.T)
        self._finish()

    @torch.inference_mode()
    def _step(self) -> None:
        """One chunk: forward with the mixed attention, surprisal, then commit what is old."""
        s, lay = self.state, self.layout
        a = self._last = s.next
        b = min(self.T, a + max(lay.chunk, lay.sinks if a == 0 else 0))
        t0 = time.perf_counter()
        shift = max(0, s.commit_end - lay.band_end) if lay.bounded else 0
        positions = torch.arange(a, b) - shift
        like = torch.zeros(1, device=self.device, dtype=self.dtype)
        waiting = torch.arange(s.commit_end, max(a, s.commit_end)) - shift  # none at first
        cos, sin = lay.rope.tables(waiting, like)
        moments = s.moments if s.sketch_basis is None else None
        window = (s.pending_k, s.pending_v, cos, sin)
        pool_end = s.commit_end - shift if a > 0 else None
        self.max_position = max(self.max_position, int(positions[-1]))
        hidden, keys, values = self.reader.read(self.ids[a:b], positions, window, moments, pool_end)
        # row i predicts token a + i + 1 (the last row: the next chunk's first token)
        last = min(b + 1, self.T)
        nll = self.nll(hidden[: last - a - 1], self.ids[a + 1 : last])
        s.surprisal[a + 1 : last] = nll.cpu().numpy()
        keys = lay.rope.unrotate(keys, positions)  # (L, H, c, D) post-RoPE -> pre-RoPE
        s.pending_k = torch.cat([s.pending_k, keys], dim=2)
        s.pending_v = torch.cat([s.pending_v, values], dim=2)
        if a == 0:  # the prompt head + first document tokens become the sinks
            ns = lay.sinks
            s.sink_k = s.pending_k[:, :, :ns].clone()  # not a view of the chunk
            s.sink_v = s.pending_v[:, :, :ns].clone()
            s.pending_k, s.pending_v = s.pending_k[:, :, ns:], s.pending_v[:, :, ns:]
            self._start_memory()
        s.next = b
        self.timings["forward_s"] += time.perf_counter() - t0
        held = (s.pending_k.numel() + s.pending_v.numel()) * s.pending_k.element_size()
        self.peak_window_bytes = max(self.peak_window_bytes, held)
        if b == self.T or b - s.commit_end >= lay.window + lay.chunk:
            t0 = time.perf_counter()
            # the complete spans older than the window (all tokens at the end), part by part
            # (the memory a commit needs stays bounded)
            while self._commit_part(final=b == self.T) and s.commit_end < self.T:
                pass
            self.timings["commit_s"] += time.perf_counter() - t0

    def _start_memory(self) -> None:
        """The growing store, read by the next chunks: the sinks, no spans yet."""
        s, sinks = self.state, torch.arange(self.layout.sinks)
        self.store.start(sinks, self.layout.frame(s.sink_k, sinks), s.sink_v)
        self.reader.start(self.store)
        if s.sketch_basis is not None:
            self.store.place_sketch_basis(s.sketch_basis)
        if s.code is not None:
            self.store.place_codebooks(s.code)

    def _commit_part(self, final: bool) -> bool:
        """Segment the oldest waiting tokens, write them as a part, append them to the memory.
        Returns whether anything was committed."""
        s, lay, seg = self.state, self.layout, self.segment
        c, b = s.commit_end, s.next
        doc = s.surprisal[self.doc_start : b].astype(np.float64)
        s.threshold = float(doc.mean() + seg.alpha * doc.std()) if len(doc) else 0.0
        limit = self.T if final else b - lay.window
        # parts of at most two chunks; but a document that never left the window is committed
        # in one part, as the one-shot build segments and quantises it
        found = self._spans(
            final, min(limit, c + 2 * lay.chunk) if self.store.tier.files else limit
        )
        if found is None:
            return False
        spans, chosen, end = found
        if s.sketch_basis is None:  # the sketch's directions and the codes, from what waits
            whole = self._spans(final, limit) if final else None  # final: all span tokens
            self._fit_tables(whole[0] if whole else None)
        s.roles[c:end] = SPAN
        s.roles[chosen] = ANCHOR
        self.store.commit(self._part(end, spans, chosen))
        self.reader.refresh()
        s.pending_k = s.pending_k[:, :, end - c :]
        s.pending_v = s.pending_v[:, :, end - c :]
        s.commit_end = end
        return True

    def _spans(
        self, final: bool, limit: int
    ) -> tuple[list[tuple[int, int]], list[int], int] | None:
        """Spans and anchors of the waiting tokens up to ``limit`` (the complete spans only; the
        last one too when ``final``): (spans [(start, end)], anchor positions, end of the last
        span), or None. Anchors stay within the document's cap, those committed counted."""
        s, seg, T = self.state, self.segment, self.T
        c, h = s.commit_end, s.surprisal
        cuts = span_cuts(h, c, s.next, s.threshold, seg, T, final)
        ends = [e for e in ([*cuts[1:], T] if final else cuts[1:]) if e <= limit]
        if not ends or ends[-1] <= c:
            return None
        end = ends[-1]
        openers = cuts[: len(ends)]
        peaks = [o for o in openers if o > self.layout.sinks and h[o] > s.threshold]
        allowed = int(seg.anchor_cap * max(end - self.doc_start, 1)) - self.store.anchors
        chosen = sorted(sorted(peaks, key=lambda o: -h[o])[: max(allowed, 0)])
        is_anchor = set(chosen)
        starts = [o + (o in is_anchor) for o in openers]
        spans = [(a, e) for a, e in zip(starts, ends, strict=True) if e > a]
        if not spans:  # only one-token spans behind anchors: keep them as spans (parts hold spans)
            chosen, spans = [], list(zip(openers, ends, strict=True))
        return spans, chosen, end

    def _fit_tables(self, spans: list[tuple[int, int]] | None) -> None:
        """The sketch's directions and the offload code, fitted once, at the first commit, to
        the waiting tokens of ``spans`` (None: all of them), and placed in the growing store:
        the sketch to their keys as the store keeps them, the key code to their pre-RoPE keys
        (both weighted by the queries seen so far), the value code to their values."""
        s, settings, c = self.state, self.settings, self.state.commit_end
        rows = span_rows(spans, c) if spans is not None else torch.arange(s.next - c)
        keys = s.pending_k[:, :, rows].float().cpu()  # pre-RoPE
        values = s.pending_v[:, :, rows].float().cpu()
        with one_thread():
            moment = s.moments.moment()
            framed = self.layout.frame(keys, rows + c)
            s.sketch_basis = sketch_basis(framed, moment, settings.sketch_dim)
            k = fit_code(keys, settings.key_code, "store.key_code", moment)
            v = fit_code(values, settings.value_code, "store.value_code")
        s.code = {**k.tensors("k"), **v.tensors("v")}
        self.store.place_sketch_basis(s.sketch_basis)
        self.store.place_codebooks(s.code)

    def _part(
        self, end: int, spans: list[tuple[int, int]], anchors: list[int]
    ) -> dict[str, torch.Tensor]:
        """The tensors of the part of waiting tokens up to ``end`` (CPU): its ``spans``
        [(start, end)] and ``anchors`` (context positions), their sketch rows, the span tokens'
        K/V records in the store's codes, and the anchors' K/V."""
        s, c, frame = self.state, self.state.commit_end, self.layout.frame
        keys_pre = s.pending_k[:, :, : end - c].float().cpu()  # (L, H, n, D)
        values = s.pending_v[:, :, : end - c].float().cpu()
        framed, codes = frame(keys_pre, torch.arange(c, end)), self.store.codes
        starts = torch.tensor([a for a, _ in spans], dtype=torch.int64).reshape(-1)
        ends = torch.tensor([e for _, e in spans], dtype=torch.int64).reshape(-1)
        rows = span_rows(spans, c)
        sketch = s.sketch_basis.project(framed[:, :, rows])  # (L, H, S, R)
        quantized = quantize_sketch(sketch, self.settings.sketch_bits)
        span_h = torch.from_numpy(s.surprisal[c:end].copy())[rows]  # part-local sketch rows
        rel = torch.tensor(anchors, dtype=torch.int64) - c
        return {
            "span_starts": starts,
            "span_ends": ends,
            "sketch": quantized["sketch"].contiguous(),
            "sketch_scale": quantized["sketch_scale"],
            "span_reps": span_representatives(span_h, ends - starts),
            "anchor_pos": torch.tensor(anchors, dtype=torch.int64),
            "anchor_k": framed[:, :, rel].to(STORE_DTYPE).contiguous(),
            "anchor_v": values[:, :, rel].to(STORE_DTYPE).contiguous(),
            "k_rows": codes["k"].encode(keys_pre[:, :, rows]).flatten(),
            "v_rows": codes["v"].encode(values[:, :, rows]).flatten(),
        }

    def _resume(self, warn: Callable[[str], None] | None) -> bool:
        """Continue from a verified checkpoint; discard the work directory otherwise."""
        try:
            found = self.checkpoints.read(self.device)
        except CheckpointInvalid as exc:
            if warn:
                warn(f"restarting the ingest of {self.document.path.name}: {exc}")
            found = None
        if found is None:
            self.checkpoints.clean()
            return False
        self.state, parts = found
        if self.state.next > 0:
            self._start_memory()
        for meta in parts:
            self.store.replay(meta)
            self.reader.refresh()
        return True

    def _finish(self) -> None:
        """Hand the parts' tables and records to the one writer of stores."""
        s, lay = self.state, self.layout
        sinks = torch.arange(lay.sinks)
        sink_k = lay.frame(s.sink_k.float().cpu(), sinks)
        tables, records = self.store.finished(sinks, sink_k, s.sink_v)
        trace = trace_tensors(self.document, self.source.context, s.surprisal, s.roles)
        starts, ends = tables.span_starts.numpy(), tables.span_ends.numpy()
        seg = Segmentation(s.roles, starts, ends, s.threshold)
        report = {
            "stats": seg.stats(),
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
            "stream": self.report(),
        }
        built = BuiltStore(lay.positions, tables, self.store.codes, records, trace, report)
        write_store(self.path, self.source, built)

    def report(self) -> dict[str, Any]:
        """What the stream did: window, positions, speed, memory held (for the manifest)."""
        lay = self.layout
        return {
            "window": lay.window,
            "chunk": lay.chunk,
            "budget": lay.budget,
            "positions": lay.positions["mode"],
            "max_position": self.max_position,
            "parts": len(self.store.tier.files),
            "peak_window_bytes": self.peak_window_bytes,
            "memory_resident_bytes": self.reader.resident_bytes(),
            "tokens_per_s_at": speed_along(self.chunk_times, self.T),
        }


def span_rows(spans: list[tuple[int, int]], c: int) -> torch.Tensor:
    """Indices (relative to ``c``) of the tokens of ``spans``, in order."""
    if not spans:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(a, e) for a, e in spans]) - c


def speed_along(chunk_times: list[tuple[int, int, float]], total: int) -> dict[str, float]:
    """Tokens/s over the tenth of the document before 10%, 50% and 100% of its ``total``
    tokens (``chunk_times``: (tokens done, tokens, seconds) per chunk, commits included)."""
    at = {}
    for share in (0.1, 0.5, 1.0):
        lo, hi = (share - 0.1) * total, share * total
        rows = [(n, s) for done, n, s in chunk_times if lo < done <= hi]
        if rows:
            tokens, seconds = sum(n for n, _ in rows), sum(s for _, s in rows)
            at[f"{int(share * 100)}%"] = round(tokens / seconds, 1)
    return at


def build_streamed(
    path: Path,
    source: StoreSource,
    readers: ChunkReaders,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> None:
    """Stream ``source``'s context into a store at ``path`` (resuming an interrupted build),
    its chunks read by ``readers(...)``; the builder's report is in the manifest (``stream``)."""
    StreamBuilder(path, source, readers).run(progress, warn)
