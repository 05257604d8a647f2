"""The store under construction: the spans a streamed build (:mod:`sekv_core.store.stream`)
committed so far, read by each chunk's zoom as a loaded store is (:class:`PartialStore`): its
resident tier grown part by part, its offload tier in the part files (:class:`PartFiles`).
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import StoreSettings
from ..kvquant import STORE_DTYPE
from ..sketch import (
    SketchBasis,
    dequantize_sketch,
    pack_sketch,
    requantize_sketch,
    widen_sketch_scale,
)
from .codes import Code, store_codebooks
from .format import sha256, spanless_tables
from .resident import CODEBOOKS, ResidentTier, SpanTables
from .tensorfile import file_header, map_tensors, read_tensors

OFFLOAD = ("k_rows", "v_rows")  # a part's flat buffers (offload tier): coded K/V records
OPEN_PARTS = 32  # part files kept open
HEADROOM = 1.5  # a sketch scale that must grow takes this margin (requantisations stay rare)
# what a resumed build reads back from each part (not its records or anchors' K/V)
REPLAYED = ("span_starts", "span_ends", "span_reps", "sketch", "sketch_scale", "anchor_pos")
FIXED = ("anchor_pos", "anchor_k", "anchor_v")  # read when finished


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
        self.offsets: list[dict[str, int]] = []  # each part's flat buffers' first file byte
        self._open: OrderedDict[int, int] = OrderedDict()  # part -> open descriptor

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
        self.offsets.append({name: entries[name].start for name in OFFLOAD})
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
        """Records (sum(counts), size) of buffer ``name`` at ``ranges`` (``first``, ``counts``:
        as :class:`~sekv_core.zoom.reconstruct.OffloadReader` reads them; a read per range)."""
        starts = (ranges.first * size).tolist()
        pairs = zip(starts, (ranges.counts * size).tolist(), strict=True)
        parts = [self._slice(name, a, a + n) for a, n in pairs]
        return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)).view(-1, size)

    def _slice(self, name: str, start: int, stop: int) -> torch.Tensor:
        if stop <= start:
            return torch.zeros(0, dtype=torch.uint8)
        part = bisect_right(self.bases[name], start) - 1
        at = self.offsets[part][name] + start - self.bases[name][part]
        raw = os.pread(self._descriptor(part), stop - start, at)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    def _descriptor(self, part: int) -> int:
        """An open descriptor of a part (the :data:`OPEN_PARTS` used last are kept open)."""
        if part not in self._open:
            self._open[part] = os.open(self.paths[part], os.O_RDONLY)
            while len(self._open) > OPEN_PARTS:
                os.close(self._open.popitem(last=False)[1])
        self._open.move_to_end(part)
        return self._open[part]

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()


class PartialStore:
    """The spans committed so far, read as a :class:`~sekv_core.store.load.SpanStore` is by
    :class:`~sekv_core.zoom.memory.SpanMemory`: a :class:`~.resident.ResidentTier` grown part by
    part (routing tables and sketch on ``device``, at ``keep`` precision), the offload tier in
    the part files of ``work``."""

    def __init__(
        self,
        work: Path,
        manifest: dict[str, Any],
        settings: StoreSettings,
        device: torch.device,
        keep: torch.dtype,
    ) -> None:
        self.manifest, self.settings = manifest, settings
        self.resident: ResidentTier  # from start() on
        self.bits, self.dim = settings.sketch_bits, settings.sketch_dim
        self.device, self.keep = device, keep
        self.tier = PartFiles(work)  # the offload tier, read range by range
        self.grow = {"sketch": Grow(2)}
        self.grow.update(span_starts=Grow(0), span_ends=Grow(0), span_reps=Grow(0))
        self.rows = 0  # span tokens committed (offload rows per layer and head)
        self.sketch_scale: torch.Tensor | None = None  # (L, H, R) float32, grows rarely
        self.anchors = 0  # anchors committed so far
        self.codes: dict[str, Code]  # the offload code the parts are written in, from start()

    def start(self, sinks: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor) -> None:
        """No spans yet: the sinks (positions; K (L, H, n, D) as the store keeps them; V), and
        the tables of a store without span tokens (:func:`~.format.spanless_tables`) until the
        first commit places the stream's own."""
        L, H, _, D = sink_k.shape
        dev, keep = self.device, self.keep
        none = spanless_tables(L, H, D, self.settings)
        R = none["sketch_scale"].shape[-1]
        self.resident = ResidentTier(
            fixed_pos=sinks,
            fixed_k=sink_k.to(keep),
            fixed_v=sink_v.to(keep),
            span_starts=torch.zeros(0, dtype=torch.int64),
            span_ends=torch.zeros(0, dtype=torch.int64),
            span_reps=torch.zeros(0, 4, dtype=torch.int64, device=dev),
            sketch_proj=none["sketch_proj"].to(dev, keep),
            sketch_key=none["sketch_key"],
            sketch_mean=none["sketch_mean"].to(dev, keep),
            sketch_scale=none["sketch_scale"].to(dev, keep),
            fixed_k_scale=None,
            fixed_v_scale=None,
            sketch=pack_sketch(torch.zeros(L, H, 0, R), self.bits).to(dev),
            part_rows=torch.zeros(1, dtype=torch.int64),
            codebooks={},
        )
        self.place_codebooks(none)

    def place_sketch_basis(self, basis: SketchBasis) -> None:
        """The sketch's query side on the device (routers read it from the resident tier)."""
        r = self.resident
        r.sketch_proj = basis.query_proj.to(self.device, self.keep)
        r.sketch_mean = basis.mean.to(self.device, self.keep)
        r.sketch_key = basis.key_proj.to(STORE_DTYPE)  # the host's: for the file

    def place_codebooks(self, tensors: dict[str, torch.Tensor]) -> None:
        """The offload code's codebooks (fixed at the first commit, :data:`CODEBOOKS`) and the
        codes they make (at the settings' specs)."""
        self.resident.codebooks = {name: t for name, t in tensors.items() if name in CODEBOOKS}
        s = self.settings
        self.codes = store_codebooks(self.resident.codebooks, s.key_code, s.value_code)

    def commit(self, part: dict[str, torch.Tensor]) -> None:
        """Write ``part`` as the next part file and append its spans."""
        self.tier.write(part)
        self.append(part)

    def replay(self, meta: dict[str, Any]) -> None:
        """Append a part a verified checkpoint lists (``meta``: its name and checksum), reading
        back its resident tables only."""
        self.append(self.tier.replay(meta, REPLAYED))

    def append(self, part: dict[str, torch.Tensor]) -> None:
        """Add the spans of a part (its tensors ``part``) to the resident tier."""
        self.rows += int((part["span_ends"] - part["span_starts"]).sum())
        r = self.resident
        r.part_rows = torch.cat([r.part_rows, torch.tensor([self.rows])])
        self.grow["span_starts"].extend(part["span_starts"])
        self.grow["span_ends"].extend(part["span_ends"])
        self.anchors += int(part["anchor_pos"].numel())
        self._append_sketch(part["sketch"], part["sketch_scale"].float(), part["span_reps"])
        for name, g in self.grow.items():  # (each grew with this part)
            setattr(r, name, g.value)
        r.sketch_scale = self.sketch_scale.to(self.device, self.keep)

    def _append_sketch(self, packed: torch.Tensor, scale: torch.Tensor, reps: torch.Tensor) -> None:
        """Requantise a part's sketch (own scale) to the store's one; grow the latter when a
        part exceeds it (by HEADROOM more, requantising what is stored: rare)."""
        g = self.grow["sketch"]
        if self.sketch_scale is None:
            self.sketch_scale = scale
        elif (scale > self.sketch_scale).any():  # (after the first part: rows to requantise)
            old = self.sketch_scale
            self.sketch_scale = widen_sketch_scale(g.value, old, scale, HEADROOM, self.bits)
        levels = dequantize_sketch(packed, self.dim, torch.float32)
        levels = requantize_sketch(levels, scale / self.sketch_scale, self.bits)
        rows = g.n
        g.extend(pack_sketch(levels, self.bits).to(self.device))  # on the resident device
        self.grow["span_reps"].extend((reps + rows).to(self.device))

    def close(self) -> None:
        self.tier.close()

    def finished(
        self, sinks: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor
    ) -> tuple[SpanTables, dict[str, torch.Tensor]]:
        """What :func:`~sekv_core.store.write.write_store` takes of the finished store: the
        resident tier with the sinks (positions; K (L, H, n, D) as the store keeps them; V),
        then every part's anchors as its fixed tokens; and each kind's fixed-rate records
        (L, H, S, B), copied from the part files one part at a time."""
        parts = self.tier.each(FIXED)
        tables = replace(
            self.resident,
            fixed_pos=torch.cat([sinks, *(p["anchor_pos"] for p in parts)]),
            fixed_k=torch.cat([sink_k.float().cpu(), *(p["anchor_k"].float() for p in parts)], 2),
            fixed_v=torch.cat([sink_v.float().cpu(), *(p["anchor_v"].float() for p in parts)], 2),
        )
        L, H = tables.fixed_k.shape[:2]
        records = {
            kind: torch.empty(L, H, self.rows, code.record_bytes, dtype=torch.uint8)
            for kind, code in self.codes.items()
        }
        self.tier.records(self.resident.part_rows, records)
        return tables, records
