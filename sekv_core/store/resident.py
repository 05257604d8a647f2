"""The resident tier of a span store, as one typed object: every table it holds, with its shape.

:class:`SpanTables` are the tables a build holds and :func:`~.write.write_store` writes;
:class:`ResidentTier` adds what answers read besides them. A loaded store's tier is read from its
file (:meth:`ResidentTier.read`: a missing table is an error there) and placed for answers
(:func:`placed`); a streamed build grows its own (:class:`~.partial.PartialStore`). The file's
tensor names are the fields' names (``docs/store-format.md``).

Shapes: L layers, H KV heads, D head dim, F sinks + anchors, N spans, S span tokens, R sketch
directions, P parts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from ..kvquant import STORE_DTYPE, dequantize_rows
from ..sketch import column_major

FIXED_SCALES = {"fixed_k": "fixed_k_scale", "fixed_v": "fixed_v_scale"}  # 8-bit rows' scales
# the tensors of a code (a code has those it uses: docs/store-format.md)
CODE_PARTS = ("basis", "basis_exp", "mean", "range", "metric", "bits")
CODEBOOKS = tuple(f"{kind}_{name}" for kind in "kv" for name in CODE_PARTS)
# the routing sketch's directions, mean and scales (a store without span tokens has none)
SKETCH_TABLES = ("sketch_proj", "sketch_key", "sketch_mean", "sketch_scale")
# the resident file's other tables (besides the fixed rows, the sketch's and the codes')
TABLES = ("fixed_pos", "span_starts", "span_ends", "span_reps")


@dataclass(slots=True)
class SpanTables:
    """The tables of a store's spans and fixed tokens, and its routing sketch's directions."""

    fixed_pos: torch.Tensor  # (F,) int64: context positions of the sinks, then the anchors
    # (L, H, F, D) their keys (post-RoPE at their positions; pre-RoPE in a bounded store) and
    # values: float, or the int8 codes of 8-bit rows (ResidentTier.fixed_k_scale)
    fixed_k: torch.Tensor
    fixed_v: torch.Tensor
    span_starts: torch.Tensor  # (N,) int64: each span's first context position
    span_ends: torch.Tensor  # (N,) int64: one past its last
    span_reps: torch.Tensor  # (N, 4) int64: its highest-surprisal sketch rows (the prefilter)
    sketch_proj: torch.Tensor  # (L, H, D, R): the sketch's query side, strongest first
    sketch_key: torch.Tensor  # (L, H, D, R): its key side (the rows' projection, host)
    sketch_mean: torch.Tensor  # (L, H, D): the key mean the rows are centred on
    sketch_scale: torch.Tensor  # (L, H, R): one scale per direction

    @property
    def span_tokens(self) -> int:
        """S: tokens in spans (offload rows per layer and KV head)."""
        return int((self.span_ends - self.span_starts).sum())

    def stored(self) -> SpanTables:
        """The span and sketch tables as the file holds them (host; floats in half precision);
        the fixed tokens' K/V as they are (the file holds them as 8-bit rows)."""
        kept = ("fixed_k", "fixed_v")
        return replace(
            self, **{f.name: _stored(getattr(self, f.name)) for f in _TABLES if f.name not in kept}
        )


@dataclass(slots=True)
class ResidentTier(SpanTables):
    """:class:`SpanTables` and what answers read besides them."""

    # (L, H, F) fp16: one scale per 8-bit fixed row; None where fixed_k/fixed_v are floats
    fixed_k_scale: torch.Tensor | None
    fixed_v_scale: torch.Tensor | None
    # (L, H, S, R // 2) uint8 4-bit pairs or (L, H, S, R) int8: the sketch's rows, column-major
    # once placed for answers (sekv_core.sketch.column_major)
    sketch: torch.Tensor
    part_rows: torch.Tensor  # (P + 1,) int64: each part's first span-token row, then S
    # the offload codes' tensors by their file names (k_*, v_*: CODEBOOKS), on the host
    codebooks: dict[str, torch.Tensor]

    @classmethod
    def read(
        cls, tables: SpanTables, file: dict[str, torch.Tensor], sketch: torch.Tensor
    ) -> ResidentTier:
        """A loaded store's tier: ``tables`` (:func:`file_tables` of the resident ``file``), its
        fixed rows' scales and codebooks from the file, the sketch's ``sketch`` rows; its
        records one part. KeyError naming a table the file lacks."""
        return cls(
            **{f.name: getattr(tables, f.name) for f in _TABLES},
            fixed_k_scale=file[FIXED_SCALES["fixed_k"]],
            fixed_v_scale=file[FIXED_SCALES["fixed_v"]],
            sketch=sketch,
            part_rows=torch.tensor([0, tables.span_tokens]),
            codebooks={name: t for name, t in file.items() if name in CODEBOOKS},
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the tier holds, by its name in the file (a scale it does not hold
        left out)."""
        held = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "codebooks"}
        return {**{n: t for n, t in held.items() if t is not None}, **self.codebooks}


_TABLES = fields(SpanTables)


def file_tables(file: dict[str, torch.Tensor]) -> SpanTables:
    """The :class:`SpanTables` of a resident file's tensors (by name). KeyError naming a table
    it lacks."""
    return SpanTables(**{f.name: file[f.name] for f in _TABLES})


def placed(
    resident: ResidentTier, device: torch.device, dtype: torch.dtype, bounded: bool
) -> ResidentTier:
    """The tier at the precision and on the ``device`` answers use it: 8-bit fixed rows as
    stored (a ``bounded`` store's keys, pre-RoPE, as fp16 numbers the memory rotates), the
    sketch column-major (the layout routing reads fastest), its directions and fixed floats in
    ``dtype``, its mean and the spans' representatives on the device."""
    r = resident
    fixed_k, fixed_v = r.fixed_k, r.fixed_v
    if bounded:
        fixed_k = dequantize_rows(fixed_k, r.fixed_k_scale, STORE_DTYPE)
        fixed_v = dequantize_rows(fixed_v, r.fixed_v_scale, STORE_DTYPE)
    floats = {"fixed_k": fixed_k, "fixed_v": fixed_v}
    floats.update(sketch_proj=r.sketch_proj, sketch_scale=r.sketch_scale)
    return replace(
        r,
        # (8-bit fixed rows stay as they are)
        **{n: t.to(dtype=dtype) if t.is_floating_point() else t for n, t in floats.items()},
        fixed_k_scale=None if bounded else r.fixed_k_scale,
        fixed_v_scale=None if bounded else r.fixed_v_scale,
        sketch_mean=r.sketch_mean.to(device=device, dtype=dtype),
        sketch=column_major(r.sketch),
        span_reps=r.span_reps.to(device),
    )


def _stored(t: torch.Tensor) -> torch.Tensor:
    """A table as the file holds it: on the host, floats in half precision."""
    t = t.detach().cpu()
    return (t.to(STORE_DTYPE) if t.is_floating_point() else t).contiguous()
