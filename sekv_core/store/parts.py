"""A streamed build's work directory: its part files and its checkpoints.

A streamed build (:mod:`sekv_core.store.stream`) commits its oldest waiting tokens as *parts*: their
spans and anchors (:func:`part_spans`: the segmentation rule, with the threshold read so far) and
their tensors (:func:`part_tensors`: coded K/V records, sketch rows, anchors' K/V), one
safetensors file per commit in ``stores/.partial-<key>/``, written atomically and checksummed
(:func:`write_part`). After a chunk the stream's state (:class:`StreamState`) is checkpointed
beside them with every part's checksum (:class:`Checkpoints`): a rerun continues from a
checkpoint only when all of it verifies, and starts over otherwise. The build runs under the
store's lock (:func:`sekv_core.store.locks.store_lock`): one process builds a given store.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..config import SegmentSettings, StoreSettings
from ..segment import SINK, SPAN, span_cuts
from ..sketch import (
    QueryMoments,
    SketchBasis,
    quantize_sketch,
    sketch_basis,
    sketch_from_state,
    sketch_state,
    span_representatives,
)
from ..summary import STORE_DTYPE, one_thread
from .codes import Code, fit_code
from .format import manifest_digest, sha256
from .locks import STATE_VERSION
from .resident import CODEBOOKS

OFFLOAD = ("k_rows", "v_rows")  # a part's flat buffers (offload tier): coded K/V records


@dataclass
class StreamState:
    """The stream between two chunks: what a checkpoint holds besides the parts.

    The waiting tokens are [commit_end, next): read, not committed yet. pending_k, pending_v :
    (L, H, W, D) their K (pre-RoPE) and V; sink_k, sink_v : (L, H, n, D) the sinks'; surprisal,
    roles : (T,) of every context token (read so far); threshold : the segmentation threshold
    of the last commit; sketch_basis : fixed at the first commit, before which ``moments`` sums
    the queries seen (the sketch's weighting); code : the offload code's codebook tensors
    (:data:`~sekv_core.store.resident.CODEBOOKS`), fixed at the first commit too.
    """

    next: int
    commit_end: int
    threshold: float
    pending_k: torch.Tensor
    pending_v: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    surprisal: np.ndarray
    roles: np.ndarray
    sketch_basis: SketchBasis | None = None
    moments: QueryMoments = field(default_factory=QueryMoments)
    code: dict[str, torch.Tensor] | None = None

    @classmethod
    def start(
        cls,
        tokens: int,
        sinks: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> StreamState:
        """Nothing read of ``tokens`` context tokens, the first ``sinks`` of them sinks; K/V of
        ``shape`` (L, H, D)."""
        L, H, D = shape
        pending_k = torch.zeros(L, H, 0, D, dtype=dtype, device=device)
        pending_v = torch.zeros_like(pending_k)
        roles = np.full(tokens, SPAN, dtype=np.int8)
        roles[:sinks] = SINK
        surprisal = np.zeros(tokens, dtype=np.float32)
        # the sinks' K/V are set by the first chunk
        return cls(0, sinks, 0.0, pending_k, pending_v, pending_k, pending_v, surprisal, roles)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint saves (CPU)."""
        return {
            "pending_k": self.pending_k.cpu(),
            "pending_v": self.pending_v.cpu(),
            "sink_k": self.sink_k.cpu(),
            "sink_v": self.sink_v.cpu(),
            "surprisal": torch.from_numpy(self.surprisal),
            "roles": torch.from_numpy(self.roles),
            **sketch_state(self.sketch_basis, self.moments),
            **(self.code or {}),
        }

    @classmethod
    def restore(
        cls, counters: dict[str, Any], t: dict[str, torch.Tensor], device: torch.device
    ) -> StreamState:
        """The state a checkpoint saved: its ``counters`` and :meth:`tensors`, K/V to ``device``."""
        basis, moments = sketch_from_state(t)
        return cls(
            counters["next"],
            counters["commit_end"],
            counters["threshold"],
            t["pending_k"].to(device),
            t["pending_v"].to(device),
            t["sink_k"].to(device),
            t["sink_v"].to(device),
            t["surprisal"].numpy().copy(),
            t["roles"].numpy().copy(),
            basis,
            moments,
            {name: t[name] for name in CODEBOOKS if name in t} if CODEBOOKS[0] in t else None,
        )


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


def write_part(work: Path, index: int, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Write part ``index`` into ``work`` atomically; returns its name and sha256 (as
    checkpoints list it)."""
    name = f"part-{index:05d}.safetensors"
    tmp = work / f".{name}.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, work / name)
    return {"name": name, "sha256": sha256(work / name)}


class CheckpointInvalid(Exception):
    """A checkpoint that does not verify (another store's or version, damaged, missing)."""


class Checkpoints:
    """The checkpoints of the build of ``store`` in its work directory ``work``.

    Each writes the state's tensors to a new ``state-<ms>.safetensors``, then replaces
    ``state.json`` (counters, the checksums of those tensors and of every part) atomically: a
    crash at any point leaves the last complete checkpoint. ``document``, the document's
    absolute path, is recorded for `sekv stores list` to name the interrupted ingest.
    """

    def __init__(self, work: Path, store: str, document: str | None = None) -> None:
        self.work, self.store, self.document = work, store, document

    def write(self, state: StreamState, parts: list[dict[str, Any]]) -> None:
        """Checkpoint ``state`` after the ``parts`` committed so far."""
        name = f"state-{int(time.time() * 1000)}.safetensors"
        tensors = state.tensors()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.work / name))
        record = {
            "version": STATE_VERSION,
            "store": self.store,
            "document": self.document,
            "next": state.next,
            "commit_end": state.commit_end,
            "threshold": state.threshold,
            "parts": parts,
            "tensors": {"name": name, "sha256": sha256(self.work / name)},
        }
        record["digest"] = manifest_digest(record)  # a flipped count is never resumed from
        tmp = self.work / "state.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.work / "state.json")
        for old in self.work.glob("state-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)

    def read(self, device: torch.device) -> tuple[StreamState, list[dict[str, Any]]] | None:
        """The last checkpoint's state (K/V on ``device``) and parts; None when there is none.
        Raises CheckpointInvalid unless its version, store, digest and every checksum match."""
        file = self.work / "state.json"
        if not file.exists():
            return None
        try:
            record = json.loads(file.read_text())
            ok = record.get("version") == STATE_VERSION and record.get("store") == self.store
            ok = ok and record.get("digest") == manifest_digest(record)
            files = [*record["parts"], record["tensors"]]
            ok = ok and all(sha256(self.work / f["name"]) == f["sha256"] for f in files)
            if not ok:
                raise ValueError("checkpoint does not match")
            tensors = load_file(self.work / record["tensors"]["name"])
        except Exception as exc:  # also safetensors' own errors on a damaged file
            raise CheckpointInvalid(str(exc)) from exc
        return StreamState.restore(record, tensors, device), record["parts"]

    def clean(self) -> None:
        """Drop parts and checkpoints."""
        for file in self.work.iterdir():
            file.unlink(missing_ok=True)


def read_tensors(path: Path, names: tuple[str, ...], sizes: tuple[str, ...] = ()) -> dict[str, Any]:
    """Tensors ``names`` of a safetensors file (only those are read), and the element counts
    of ``sizes``."""
    with safe_open(str(path), framework="pt") as f:
        out: dict[str, Any] = {name: f.get_tensor(name) for name in names}
        for name in sizes:
            out[name] = math.prod(f.get_slice(name).get_shape())
    return out
