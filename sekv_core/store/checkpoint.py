"""A streamed build's state between two chunks, and where it is kept: its part files and its
checkpoints, in ``stores/.partial-<key>/``.

A streamed build (:mod:`sekv_core.store.stream`) commits its oldest waiting tokens as *parts*
(:mod:`sekv_core.store.parts`): one safetensors file each, written atomically and checksummed,
which :class:`PartFiles` keeps in order and reads back (the growing store's offload tier, range
by range). After a chunk the stream's state (:class:`StreamState`) is checkpointed beside them
with every part's checksum (:class:`Checkpoints`): a rerun continues from a checkpoint only when
all of it verifies (:func:`sekv_core.store.locks.resumable` tells, without verifying, whether one
may), and starts over otherwise. The build runs under the store's lock
(:func:`sekv_core.store.locks.store_lock`): one process builds a given store.
"""

from __future__ import annotations

import json
import os
import time
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from ..segment import SINK, SPAN
from ..sketch import QueryMoments, SketchBasis, sketch_from_state, sketch_state
from .format import manifest_digest, sha256
from .locks import STATE_VERSION
from .resident import CODEBOOKS
from .tensorfile import file_header, map_tensors, read_tensors

OFFLOAD = ("k_rows", "v_rows")  # a part's flat buffers (offload tier): coded K/V records
OPEN_PARTS = 32  # part files kept open


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


class PartFiles:
    """The part files of a streamed build in ``work``, in order: each written (:meth:`write`) or
    listed by a verified checkpoint (:meth:`replay`); ``files`` their names and checksums, as
    checkpoints list them. Their records are the growing store's offload tier
    (:meth:`offload_records`), read through ``os.pread`` (not memory maps: pages a map touched
    would stay in the process's resident set, part after part).
    """

    def __init__(self, work: Path) -> None:
        self.work = work
        self.files: list[dict[str, Any]] = []  # name and sha256 of each part, in order
        self.paths: list[Path] = []
        self.bases: dict[str, list[int]] = {name: [] for name in OFFLOAD}  # each part's first
        self.totals = dict.fromkeys(OFFLOAD, 0)  # bytes of each flat buffer, all parts
        self._open: OrderedDict[int, tuple[int, dict[str, int]]] = OrderedDict()

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write the next part atomically."""
        name = f"part-{len(self.files):05d}.safetensors"
        tmp = self.work / f".{name}.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, self.work / name)
        self._add({"name": name, "sha256": sha256(self.work / name)})

    def replay(self, meta: dict[str, Any], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Add the part a verified checkpoint lists (``meta``: its name and checksum); returns
        its tensors ``names`` (read back; not its records)."""
        self._add(meta)
        return read_tensors(self.paths[-1], names)

    def _add(self, meta: dict[str, Any]) -> None:
        path = self.work / meta["name"]
        with open(path, "rb") as f:
            entries = file_header(f)
        self.files.append(meta)
        self.paths.append(path)
        for name in OFFLOAD:  # the global offset of each of its flat buffers
            self.bases[name].append(self.totals[name])
            self.totals[name] += entries[name].stop - entries[name].start

    def each(self, names: tuple[str, ...]) -> list[dict[str, torch.Tensor]]:
        """Every part's tensors ``names``, in order."""
        return [read_tensors(path, names) for path in self.paths]

    def records(self, part_rows: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        """Copy every part's records into ``out`` (each kind's (L, H, S, B) uint8), one part
        mapped at a time (``part_rows`` (P + 1,): each part's first row, then S)."""
        at = 0
        for path, n in zip(self.paths, torch.diff(part_rows).tolist(), strict=True):
            mapped = map_tensors(path, OFFLOAD)
            for kind, rows in out.items():
                L, H = rows.shape[:2]
                rows[:, :, at : at + n] = mapped[f"{kind}_rows"].view(L, H, n, -1)
            at += n

    def offload_records(self, name: str, size: int, ranges: Any) -> torch.Tensor:
        """Records (sum(counts), size) at ``ranges`` (``first``, ``counts``: as
        :class:`~sekv_core.zoom.reconstruct.OffloadReader` reads them; a read per range)."""
        start = ranges.first * size
        return self.offload_ranges(name, start, start + ranges.counts * size).view(-1, size)

    def offload_ranges(self, name: str, starts: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
        """Bytes [starts[i], stops[i]) of buffer ``name`` for every i, one after another."""
        pairs = zip(starts.tolist(), stops.tolist(), strict=True)
        parts = [self._slice(name, a, b) for a, b in pairs]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)

    def _slice(self, name: str, start: int, stop: int) -> torch.Tensor:
        if stop <= start:
            return torch.zeros(0, dtype=torch.uint8)
        part = bisect_right(self.bases[name], start) - 1
        fd, data = self._file(part)
        raw = os.pread(fd, stop - start, data[name] + start - self.bases[name][part])
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    def _file(self, part: int) -> tuple[int, dict[str, int]]:
        """An open descriptor of a part and the byte offset of each offload buffer in it."""
        if part in self._open:
            self._open.move_to_end(part)
            return self._open[part]
        fd = os.open(self.paths[part], os.O_RDONLY)
        with os.fdopen(os.dup(fd), "rb") as f:
            entries = file_header(f)
        data = {n: entries[n].start for n in OFFLOAD}
        self._open[part] = (fd, data)
        while len(self._open) > OPEN_PARTS:
            os.close(self._open.popitem(last=False)[1][0])
        return fd, data

    def close(self) -> None:
        for fd, _ in self._open.values():
            os.close(fd)
        self._open.clear()


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
            tensors = read_tensors(self.work / record["tensors"]["name"])
        except Exception as exc:  # also safetensors' own errors on a damaged file
            raise CheckpointInvalid(str(exc)) from exc
        return StreamState.restore(record, tensors, device), record["parts"]

    def clean(self) -> None:
        """Drop parts and checkpoints."""
        for file in self.work.iterdir():
            file.unlink(missing_ok=True)
