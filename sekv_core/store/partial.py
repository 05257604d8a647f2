"""The store under construction: the spans a streamed build committed so far, part by part.

:class:`PartialStore` is read as a :class:`~sekv_core.store.load.SpanStore` is by
:class:`~sekv_core.zoom.memory.SpanMemory` (its ``manifest``, ``resident`` tier and offload
``reader``), so each chunk of the stream zooms into what the chunks before it committed: its
resident tier grows with every part (the routing sketch requantised to one scale per direction),
its offload tier stays in the part files and is read back range by range
(:class:`~sekv_core.store.checkpoint.PartFiles`). When the stream ends it hands the finished
store's tables and the parts' records to :func:`~sekv_core.store.write.write_store`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config import StoreSettings
from ..sketch import (
    SketchBasis,
    dequantize_sketch,
    pack_sketch,
    requantize_sketch,
    sketch_dtype,
    widen_sketch_scale,
)
from ..summary import STORE_DTYPE
from .checkpoint import PartFiles
from .codes import Code, fit_code, store_codebooks
from .resident import CODEBOOKS, ResidentTier, SpanTables

HEADROOM = 1.5  # a sketch scale that must grow takes this margin (requantisations stay rare)
# what a resumed build reads back from each part (not its records or anchors' K/V)
REPLAYED = (
    "span_starts",
    "span_ends",
    "span_reps",
    "sketch",
    "sketch_scale",
    "anchor_pos",
)
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
        self.parts = PartFiles(work)  # the offload tier: the growing store's reader
        self.grow = {"sketch": Grow(2)}
        self.grow.update(span_starts=Grow(0), span_ends=Grow(0), span_reps=Grow(0))
        self.rows = 0  # span tokens committed (offload rows per layer and head)
        self.sketch_scale: torch.Tensor | None = None  # (L, H, R) float32, grows rarely
        self.anchors = 0  # anchors committed so far

    @property
    def reader(self) -> PartFiles:
        """How the offload tier is read: from the part files, range by range."""
        return self.parts

    def start(self, sinks: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor) -> None:
        """No spans yet: the sinks (positions; K (L, H, n, D) as the store keeps them; V)."""
        L, H, D = sink_k.shape[0], sink_k.shape[1], sink_k.shape[3]
        R, bits, dev, keep = self.dim, self.bits, self.device, self.keep
        empty = torch.zeros(L, H, 0, D)
        # no spans yet: any codebook (the stream places its own at the first commit)
        codes = fit_code(empty, self.settings.key_code), fit_code(empty, self.settings.value_code)
        self.resident = ResidentTier(
            fixed_pos=sinks,
            fixed_k=sink_k.to(keep),
            fixed_v=sink_v.to(keep),
            span_starts=torch.zeros(0, dtype=torch.int64),
            span_ends=torch.zeros(0, dtype=torch.int64),
            span_reps=torch.zeros(0, 4, dtype=torch.int64, device=dev),
            sketch_proj=torch.zeros(L, H, D, R, dtype=keep, device=dev),
            sketch_key=torch.zeros(L, H, D, R, dtype=STORE_DTYPE),
            sketch_mean=torch.zeros(L, H, D, dtype=keep, device=dev),
            sketch_scale=torch.ones(L, H, R, dtype=keep, device=dev),
            fixed_k_scale=None,
            fixed_v_scale=None,
            sketch=torch.zeros(
                L, H, 0, R // 2 if bits == 4 else R, dtype=sketch_dtype(bits), device=dev
            ),
            part_rows=torch.zeros(1, dtype=torch.int64),
            codebooks={**codes[0].tensors("k"), **codes[1].tensors("v")},
        )

    def place_sketch_basis(self, basis: SketchBasis) -> None:
        """The sketch's query side on the device (routers read it from the resident tier)."""
        r = self.resident
        r.sketch_proj = basis.query_proj.to(self.device, self.keep)
        r.sketch_mean = basis.mean.to(self.device, self.keep)
        r.sketch_key = basis.key_proj.to(STORE_DTYPE)  # the host's: for the file

    def place_codebooks(self, tensors: dict[str, torch.Tensor]) -> None:
        """The offload code's codebooks (fixed at the first commit, :data:`CODEBOOKS`)."""
        self.resident.codebooks = {name: t for name, t in tensors.items() if name in CODEBOOKS}

    def codebooks(self) -> dict[str, Code]:
        """The offload code the parts are written in (its codebooks at the settings' tiers)."""
        s = self.settings
        return store_codebooks(self.resident.codebooks, s.key_code, s.value_code)

    def commit(self, part: dict[str, torch.Tensor]) -> None:
        """Write ``part`` as the next part file and append its spans."""
        self.parts.write(part)
        self.append(part)

    def replay(self, meta: dict[str, Any]) -> None:
        """Append a part a verified checkpoint lists (``meta``: its name and checksum), reading
        back its resident tables only."""
        self.append(self.parts.replay(meta, REPLAYED))

    def append(self, part: dict[str, torch.Tensor]) -> None:
        """Add the spans of a part (its tensors ``part``) to the resident tier."""
        self.rows += int((part["span_ends"] - part["span_starts"]).sum())
        r = self.resident
        r.part_rows = torch.cat([r.part_rows, torch.tensor([self.rows])])
        self.grow["span_starts"].extend(part["span_starts"])
        self.grow["span_ends"].extend(part["span_ends"])
        self.anchors += int(part["anchor_pos"].numel())
        self._append_sketch(part["sketch"], part["sketch_scale"].float(), part["span_reps"])
        for name, g in self.grow.items():
            if g.buf is not None:
                setattr(r, name, g.value)
        r.sketch_scale = self.sketch_scale.to(self.device, self.keep)

    def _append_sketch(self, packed: torch.Tensor, scale: torch.Tensor, reps: torch.Tensor) -> None:
        """Requantise a part's sketch (own scale) to the store's one; grow the latter when a
        part exceeds it (by HEADROOM more, requantising what is stored: rare)."""
        g = self.grow["sketch"]
        if self.sketch_scale is None:
            self.sketch_scale = scale
        elif (scale > self.sketch_scale).any():
            stored = g.value if g.buf is not None else None
            self.sketch_scale = widen_sketch_scale(
                stored, self.sketch_scale, scale, HEADROOM, self.bits
            )
        levels = dequantize_sketch(packed, self.dim, torch.float32)
        levels = requantize_sketch(levels, scale / self.sketch_scale, self.bits)
        rows = g.n
        g.extend(pack_sketch(levels, self.bits).to(self.device))  # on the resident device
        self.grow["span_reps"].extend((reps + rows).to(self.device))

    def close(self) -> None:
        self.parts.close()

    def finished(self, sinks: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor):
        """The finished store's tables for :func:`~sekv_core.store.write.write_store` (CPU):
        the sinks (positions; K (L, H, n, D) as the store keeps them; V), then every part's
        anchors, the span tables, the sketch's directions and scale; and each kind's
        fixed-rate records (L, H, S, B), copied from the part files one part at a time."""
        each = self.parts.each(FIXED)
        pieces = {name: [part[name] for part in each] for name in FIXED}
        r = self.resident
        tables = SpanTables(
            fixed_pos=torch.cat([sinks, *pieces["anchor_pos"]]),
            fixed_k=torch.cat([sink_k.float().cpu(), *(t.float() for t in pieces["anchor_k"])], 2),
            fixed_v=torch.cat([sink_v.float().cpu(), *(t.float() for t in pieces["anchor_v"])], 2),
            span_starts=r.span_starts.cpu(),
            span_ends=r.span_ends.cpu(),
            span_reps=r.span_reps.cpu(),
            sketch_proj=r.sketch_proj.cpu(),
            sketch_key=r.sketch_key,
            sketch_mean=r.sketch_mean.cpu(),
            sketch_scale=r.sketch_scale.cpu(),
        )
        codes = self.codebooks()
        L, H = tables.fixed_k.shape[:2]
        records = {
            kind: torch.empty(L, H, self.rows, codes[kind].record_bytes, dtype=torch.uint8)
            for kind in ("k", "v")
        }
        self.parts.records(r.part_rows, records)
        return tables, records

    def span_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Starts and ends (N,) of the spans committed so far (CPU)."""
        return self.resident.span_starts.cpu(), self.resident.span_ends.cpu()
