"""Streamed ingest: a span store built chunk by chunk, for documents beyond the model window.

Each chunk of ``prefill_chunk`` tokens runs through the model by the caller's
:class:`ChunkReader` (the zoom's, :class:`sekv_core.zoom.chunks.ZoomedChunks`): it attends to
the sinks, the tokens not yet committed (at least ``stream.window`` of them, full resolution)
and the spans zoomed from the store built so far (``stream.budget`` tokens per layer and KV
head, routed by ``stream.route_queries`` of its queries). Once more than ``window + chunk``
tokens wait, the oldest complete spans are committed as one *part*
(:mod:`sekv_core.store.parts`): segmented with the rule of :func:`sekv_core.segment.segment`
(threshold mu + alpha sigma of the surprisal read so far), coded, written to disk and appended
to the growing store (:mod:`sekv_core.store.partial`). Held in memory: the waiting tokens, the
chunk, the zoom cache and the resident routing tier (sketch, tables); the records stay on disk.

Positions: a context beyond the window gets a *bounded* store (pre-RoPE keys everywhere) and
chunks see the layout of a bounded span memory — sinks at 0.., zoomed tokens packed before
the waiting tokens, which start at ``sinks + budget`` — so no RoPE distance reaches the window.
A book keeps no anchors (their boundary tokens stay in their spans). A context that fits
(``stream.always``) keeps original positions and anchors throughout.

Resume: after a chunk (at most every ``checkpoint_s`` seconds) the stream's state is checkpointed
beside the parts (:mod:`sekv_core.store.checkpoint`); a rerun verifies it, replays the parts and
continues, or starts over. The
finished store is written from the parts by the one writer of stores
(:func:`~sekv_core.store.write.write_store`).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ..models import LoadedModel
from ..paths import private_dir
from ..prefill import Progress, release_freed_memory
from ..rope import Rope
from ..segment import ANCHOR, SPAN, Segmentation
from ..sketch import QueryMoments
from ..summary import STORE_DTYPE
from ..surprisal import Surprisal
from .checkpoint import CheckpointInvalid, Checkpoints, StreamState
from .format import StoreSource, trace_tensors
from .layout import StreamLayout
from .partial import PartialStore
from .parts import part_spans, part_tensors, waiting_codebooks, waiting_sketch_basis
from .write import BuiltStore, write_store

CHECKPOINT_S = 30.0  # at most this long between checkpoints


class ChunkReader(Protocol):
    """What runs a stream's chunks through the model, attending to the store grown so far."""

    def attending(self) -> AbstractContextManager[None]:
        """The block :meth:`read` runs in."""
        ...

    def start(self, store: PartialStore) -> None:
        """Read ``store`` (the sinks, no spans yet) from the next chunk on."""
        ...

    def refresh(self) -> None:
        """``store`` gained a part."""
        ...

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

    def resident_bytes(self) -> int:
        """Bytes held on the device for the store."""
        ...


# makes a stream's reader: (model, its RoPE frame, zoom budget, routing queries)
ChunkReaders = Callable[[LoadedModel, Rope, int, int], ChunkReader]


class StreamBuilder:
    """Builds one store by streaming its context; see the module docstring."""

    def __init__(
        self,
        path: Path,
        source: StoreSource,
        readers: ChunkReaders,
        checkpoint_s: float = CHECKPOINT_S,
    ) -> None:
        self.path, self.source = path, source
        loaded, document, context = source.loaded, source.document, source.context
        self.loaded, self.document, self.context = loaded, document, context
        self.settings, self.readers, self.checkpoint_s = source.settings, readers, checkpoint_s
        self.work = path.with_name(f".partial-{path.name}")
        self.checkpoints = Checkpoints(self.work, path.name, os.path.abspath(document.path))
        self.T, self.doc_start = len(context), context.doc_start
        self.layout = StreamLayout.plan(source)
        # no anchors in a book: bounded positions would put them all at one place (module doc)
        bounded = self.layout.bounded
        segment = self.settings.segment
        self.segment = replace(segment, anchor_cap=0.0) if bounded else segment
        self.device, self.dtype = loaded.device, loaded.dtype
        self.keep = self.dtype if self.dtype.itemsize <= 2 else STORE_DTYPE  # resident precision
        self.ids = torch.tensor(context.ids, device=self.device)
        self.nll = Surprisal(loaded.model.get_output_embeddings())
        self.max_position = 0  # largest RoPE position a chunk used (tests: < window)
        self.peak_window_bytes = 0  # largest waiting K/V held (flat in the document's length)
        self.timings = {"forward_s": 0.0, "commit_s": 0.0, "checkpoint_s": 0.0}
        self.chunk_times: list[tuple[int, int, float]] = []  # (tokens done, tokens, seconds)
        self._fresh()

    def _fresh(self) -> None:
        """Before the first chunk: nothing read, nothing committed."""
        spec, lay = self.loaded.spec, self.layout
        shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.state = StreamState.start(self.T, lay.sinks, shape, self.dtype, self.device)
        positions = {"mode": lay.mode, "sinks": lay.sinks}
        manifest = {
            "document": {"context_tokens": self.T},
            "positions": positions,
            "settings": self.settings.to_dict(),
        }
        self.store = PartialStore(self.work, manifest, self.settings, self.device, self.keep)
        budget, queries = lay.budget, self.settings.stream.route_queries
        self.reader = self.readers(self.loaded, lay.rope, budget, queries)

    def run(
        self, progress: Progress | None = None, warn: Callable[[str], None] | None = None
    ) -> dict[str, torch.Tensor]:
        """Build (or resume) and write the store at ``path``; returns the records it holds
        decoded (:func:`~sekv_core.store.write.write_store`)."""
        private_dir(self.work)  # its parts hold the document
        try:
            store = self._run(progress, warn)
        finally:
            self.store.close()
        shutil.rmtree(self.work, ignore_errors=True)
        return store

    def _run(
        self, progress: Progress | None, warn: Callable[[str], None] | None
    ) -> dict[str, torch.Tensor]:
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
                if done or time.perf_counter() - last_checkpoint >= self.checkpoint_s:
                    t0 = time.perf_counter()
                    self.checkpoints.write(self.state, self.store.parts.files)
                    self.timings["checkpoint_s"] += time.perf_counter() - t0
                    last_checkpoint = time.perf_counter()
                release_freed_memory()
                if progress:
                    progress(self.state.next, self.T)
        return self._finish()

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
        self.store.start(sinks, self.layout.frame(s.sink_k, 0, sinks), s.sink_v)
        self.reader.start(self.store)
        if s.sketch_basis is not None:
            self.store.place_sketch_basis(s.sketch_basis)
        if s.code is not None:
            self.store.place_codebooks(s.code)

    def _commit_part(self, final: bool) -> bool:
        """Segment the oldest waiting tokens, write them as a part, append them to the memory.
        Returns whether anything was committed."""
        s, lay, settings = self.state, self.layout, self.settings
        seg, c, b = self.segment, s.commit_end, s.next
        doc = s.surprisal[self.doc_start : b].astype(np.float64)
        s.threshold = float(doc.mean() + seg.alpha * doc.std()) if len(doc) else 0.0
        limit = self.T if final else b - lay.window
        # parts of at most two chunks; but a document that never left the window is committed
        # in one part, as the one-shot build segments and quantises it
        found = self._spans(
            final, min(limit, c + 2 * lay.chunk) if self.store.parts.files else limit
        )
        if found is None:
            return False
        spans, chosen, end = found
        if s.sketch_basis is None:  # the sketch's directions, from what waits
            whole = self._spans(final, limit) if final else None  # final: all span tokens
            spans_all = whole[0] if whole else None
            s.sketch_basis = waiting_sketch_basis(s, spans_all, lay.frame, settings.sketch_dim)
            self.store.place_sketch_basis(s.sketch_basis)
            s.code = waiting_codebooks(s, spans_all, settings)
            self.store.place_codebooks(s.code)
        s.roles[c:end] = SPAN
        s.roles[chosen] = ANCHOR
        keys_pre = s.pending_k[:, :, : end - c].float().cpu()  # (L, H, n, D)
        values = s.pending_v[:, :, : end - c].float().cpu()
        h, basis, codes = (
            s.surprisal[c:end],
            s.sketch_basis,
            self.store.codebooks(),
        )
        part = part_tensors(
            keys_pre, values, h, c, spans, chosen, basis, codes, settings, lay.frame
        )
        self.store.commit(part)
        self.reader.refresh()
        s.pending_k = s.pending_k[:, :, end - c :]
        s.pending_v = s.pending_v[:, :, end - c :]
        s.commit_end = end
        return True

    def _spans(self, final: bool, limit: int) -> tuple[list, list[int], int] | None:
        """:func:`~sekv_core.store.parts.part_spans` of the waiting tokens up to ``limit``."""
        seg, sinks = self.segment, self.layout.sinks
        return part_spans(self.state, final, limit, seg, sinks, self.doc_start, self.store.anchors)

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
            self._fresh()
            return False
        self.state, parts = found
        if self.state.next > 0:
            self._start_memory()
        for meta in parts:
            self.store.replay(meta)
            self.reader.refresh()
        return True

    def _finish(self) -> dict[str, torch.Tensor]:
        """Hand the parts' tables and records to the one writer of stores."""
        s, lay = self.state, self.layout
        sink_k = lay.frame(s.sink_k.float().cpu(), 0)
        tables, records = self.store.finished(torch.arange(lay.sinks), sink_k, s.sink_v)
        trace = trace_tensors(self.document, self.context, s.surprisal, s.roles)
        positions = {"mode": lay.mode, "sinks": lay.sinks}
        starts, ends = self.store.span_bounds()
        seg = Segmentation(s.roles, starts.numpy(), ends.numpy(), s.threshold)
        report = {
            "stats": seg.stats(),
            "timings": {k: round(v, 4) for k, v in self.timings.items()},
            "stream": self.report(),
        }
        built = BuiltStore(positions, tables, self.store.codebooks(), records, trace, report)
        return write_store(self.path, self.source, built)

    def report(self) -> dict[str, Any]:
        """What the stream did: window, positions, speed, memory held (for the manifest)."""
        lay = self.layout
        return {
            "window": lay.window,
            "chunk": lay.chunk,
            "budget": lay.budget,
            "positions": lay.mode,
            "max_position": self.max_position,
            "parts": len(self.store.parts.files),
            "peak_window_bytes": self.peak_window_bytes,
            "memory_resident_bytes": self.reader.resident_bytes(),
            "tokens_per_s_at": speed_along(self.chunk_times, self.T),
        }


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
    checkpoint_s: float | None = None,
) -> dict[str, torch.Tensor]:
    """Stream ``source``'s context into a store at ``path`` (resuming an interrupted build),
    its chunks read by ``readers(...)``; returns the records it holds decoded
    (:func:`~sekv_core.store.write.write_store`; the builder's report is in the manifest under
    ``stream``). Checkpoints at most every ``checkpoint_s`` seconds (default CHECKPOINT_S)."""
    checkpoint_s = CHECKPOINT_S if checkpoint_s is None else checkpoint_s
    builder = StreamBuilder(path, source, readers, checkpoint_s)
    return builder.run(progress, warn)
