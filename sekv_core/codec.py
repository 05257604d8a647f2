"""The offload tier's code: every span token's pre-RoPE key and value in a few bits per number.

Per (layer, KV head) and tensor kind, one *codebook* fitted over the document (a book: over its
first window of tokens): the principal directions of the rows (centred), strongest first, and
each direction's range. A row is stored as its coefficients on those directions, divided by the
range, in *tiers* of consecutive directions at fixed bits (the strongest directions carry most
of a row, so they get more bits), each tier with one fp16 scale per row (its largest magnitude).
A tier spec reads ``"8x8,24x4,32x2"``: 8 directions at 8 bits, 24 at 4, 32 at 2; 16 bits keeps
fp16 coefficients (no scale), 0 bits drops the directions.

A row's *record* is its tiers' codes and scales as bytes, all rows the same size, so a span's
rows of one (layer, head) are one contiguous range of the offload tier and decode alone, at
token resolution: records -> coefficients -> one batched product with the pairs' bases.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property

import torch

from . import kernels
from .allocated import AllocatedCode, per_head, query_metric
from .bitpack import pack_codes, unpack_codes
from .config import FIXED_SIZE_CODES
from .errors import SekvError
from .evencode import MARK, fit_even, row_bits
from .narrow import narrowed
from .summary import STORE_DTYPE, stored
from .tiers import Tier, parse_alloc, parse_even, parse_tiers, record_bytes

SCALE = torch.float16  # per-row tier scales (tiers.SCALE_BYTES each)


@dataclass
class Codebook:
    """Per (layer, KV head) directions ``basis`` (L, H, D, D) (columns strongest first), row
    ``mean`` (L, H, D) and direction ``range`` (L, H, D), float32; ``tiers`` say the bits."""

    basis: torch.Tensor
    mean: torch.Tensor
    range: torch.Tensor
    tiers: list[Tier]

    @classmethod
    def fit(cls, rows: torch.Tensor, spec: str, setting: str = "code") -> Codebook:
        """The codebook of rows (L, H, S, D) at the tiers of ``spec`` (the setting named
        ``setting``: a SekvError names it when its tiers do not fit the rows' D)."""
        try:
            tiers = parse_tiers(spec, rows.shape[-1])
        except ValueError as exc:
            raise SekvError(f"{setting}: {exc}") from None
        x = rows.float()
        if x.shape[2] == 0:  # no span tokens: any codebook
            L, H, _, D = x.shape
            eye = torch.eye(D).expand(L, H, D, D).contiguous()
            return cls(eye, x.new_zeros(L, H, D), x.new_ones(L, H, D), tiers)
        mean = x.mean(dim=2)
        bases, spans = [], []
        for layer in range(x.shape[0]):  # one layer at a time: bounded working memory
            centred = x[layer] - mean[layer][:, None]
            cov = centred.transpose(-1, -2) @ centred  # (H, D, D)
            _, vecs = torch.linalg.eigh(cov)
            basis = narrowed(vecs.flip(-1)).contiguous()  # strongest first, as stored
            bases.append(basis)
            spans.append((centred @ basis).abs().amax(dim=1).clamp(min=1e-6))
        return cls(stored(torch.stack(bases)), stored(mean), stored(torch.stack(spans)), tiers)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}_basis": self.basis.to(STORE_DTYPE),
            f"{prefix}_mean": self.mean.to(STORE_DTYPE),
            f"{prefix}_range": self.range.to(STORE_DTYPE),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str, spec: str) -> Codebook:
        basis = tensors[f"{prefix}_basis"].float()
        mean, span = tensors[f"{prefix}_mean"].float(), tensors[f"{prefix}_range"].float()
        return cls(basis, mean, span, parse_tiers(spec, basis.shape[-1]))

    @cached_property
    def record_bytes(self) -> int:  # read at every zoom: computed once
        return record_bytes(self.tiers)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Records (L, H, S, B) uint8 of rows (L, H, S, D), one layer at a time."""
        return torch.stack([self.encode_layer(rows[i], i) for i in range(rows.shape[0])])

    def record_fields(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A record's bit fields (:mod:`sekv_core.rans`), the same in every layer: widths
        (L, F), each code of each tier, then its scale's two bytes (fp16 coefficients: two
        bytes each); flips (L, F), 0x80 on 8-bit codes (int8: xored, they order as numbers)."""
        widths, flips = [], []
        for tier in self.tiers:
            if tier.bits == 16:
                widths += [8, 8] * tier.count
                flips += [0, 0] * tier.count
            elif tier.bits:
                widths += [tier.bits] * tier.count + [8, 8]
                flips += [0x80 if tier.bits == 8 else 0] * tier.count + [0, 0]
        L = self.basis.shape[0]
        w, f = torch.tensor(widths, dtype=torch.int64), torch.tensor(flips, dtype=torch.int64)
        return w.expand(L, -1).contiguous(), f.expand(L, -1).contiguous()

    def encode_layer(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        """Records (H, S, B) uint8 of one layer's rows (H, S, D)."""
        coef = ((rows.float() - self.mean[layer][:, None]) @ self.basis[layer]) / self.range[layer][
            :, None
        ]
        pieces, at = [], 0
        for tier in self.tiers:
            part = coef[..., at : at + tier.count]
            at += tier.count
            if tier.bits:
                pieces.append(_encode_tier(part, tier))
        shape = (*rows.shape[:-1], 0)
        return torch.cat(pieces, dim=-1) if pieces else torch.zeros(shape, dtype=torch.uint8)

    def decode(
        self, records: torch.Tensor, layer: int, heads: torch.Tensor | list[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows (T, D) in ``dtype`` of records (T, B) uint8 of one layer, ``heads`` (T,) their
        KV heads, ascending (rows grouped by head; or each head's rows, as
        :func:`~sekv_core.allocated.per_head` takes them); on the records' device. One product per
        head of its rows' coefficients with its synthesis map."""
        synth, mean = self.synthesis
        if records.dtype == torch.uint8 and kernels.usable(records):
            coef = kernels.tier_coefficients(records, self.tiers)  # one call on the CPU
        else:
            coef = self.coefficients(records)
        return per_head(coef, heads, synth[layer], mean[layer]).to(dtype)

    def coefficients(self, records: torch.Tensor) -> torch.Tensor:
        """Coefficients (T, D) float32 of records (T, B), dropped directions 0."""
        pieces, byte = [], 0
        for tier in self.tiers:
            if tier.bits:
                pieces.append(_decode_tier(records[:, byte : byte + tier.nbytes], tier))
                byte += tier.nbytes
            else:
                pieces.append(records.new_zeros(records.shape[0], tier.count, dtype=torch.float))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    @cached_property
    def synthesis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (layer, head) the map from coefficients back to rows (L, H, D, D): the inverse
        of the directions as stored (half precision: nearly, not exactly, orthonormal), the
        ranges folded in; and the rows' mean (L, H, D)."""
        return (self.range[..., None] * torch.linalg.inv(self.basis)).contiguous(), self.mean


Code = Codebook | AllocatedCode  # what an offload tier is written in


def fit_code(
    rows: torch.Tensor, spec: str, setting: str = "code", moment: torch.Tensor | None = None
) -> Code:
    """The code of ``spec`` (tiers, ``alloc:B`` or ``even:S``) fitted to rows (L, H, S, D);
    ``moment`` (L, H, D, D): the queries' second moment that weighs the dimensions of an
    allocated or even code (keys; None: equal weights)."""
    step = parse_even(spec)
    if step is not None:
        return fit_even(rows, step, query_metric(moment, rows))
    try:
        bits = parse_alloc(spec, rows.shape[-1])
    except ValueError as exc:
        raise SekvError(f"{setting}: {exc}") from None
    if bits is None:
        return Codebook.fit(rows, spec, setting)
    return AllocatedCode.fit(rows, bits, query_metric(moment, rows))


def record_spec(spec: str, kind: str, fixed_size: bool) -> str:
    """The spec a store codes its ``kind`` (``k`` or ``v``) records in: ``spec``, except that an
    even spec gives way to the fixed-rate code of :data:`~sekv_core.config.FIXED_SIZE_CODES`
    where the records stay fixed-size on disk (a long book's, not entropy-coded)."""
    return FIXED_SIZE_CODES[kind] if fixed_size and parse_even(spec) is not None else spec


def load_code(tensors: dict[str, torch.Tensor], prefix: str, spec: str) -> Code:
    """The code of ``spec`` from its tensors (:meth:`Codebook.tensors`); an even spec's store
    holds an even code (marked by its step), or, where its records are fixed-size, the
    fixed-rate code (:func:`record_spec`)."""
    if parse_even(spec) is not None:
        if f"{prefix}_{MARK}" in tensors:
            bits = tensors[f"{prefix}_bits"].long()
            return AllocatedCode.from_tensors(tensors, prefix, row_bits(bits))
        spec = FIXED_SIZE_CODES[prefix]
    dim = tensors[f"{prefix}_basis"].shape[-1]
    bits = parse_alloc(spec, dim)
    if bits is None:
        return Codebook.from_tensors(tensors, prefix, spec)
    return AllocatedCode.from_tensors(tensors, prefix, bits)


def store_codebooks(
    tensors: dict[str, torch.Tensor], key_code: str, value_code: str
) -> dict[str, Code]:
    """A store's offload code: its codebook ``tensors`` read at its settings' specs."""
    return {"k": load_code(tensors, "k", key_code), "v": load_code(tensors, "v", value_code)}


def _encode_tier(coef: torch.Tensor, tier: Tier) -> torch.Tensor:
    """Bytes (..., tier.nbytes) of coefficients (..., count)."""
    if tier.bits == 16:
        return _fresh(coef.to(torch.float16)).view(torch.uint8)
    scale = (coef.abs().amax(dim=-1, keepdim=True) / tier.levels).to(SCALE)
    step = scale.float().clamp(min=torch.finfo(SCALE).tiny)
    codes = (coef / step).round().clamp(-tier.levels, tier.levels)
    if tier.bits == 8:
        packed = codes.to(torch.int8).view(torch.uint8)
    else:  # 4 or 2 bits: non-negative codes, several per byte
        packed = pack_codes(codes + tier.levels, tier.bits)
    return torch.cat([packed, _fresh(scale).view(torch.uint8)], dim=-1)


def _decode_tier(chunk: torch.Tensor, tier: Tier) -> torch.Tensor:
    """Coefficients (T, count) float32 of a tier's bytes (T, tier.nbytes)."""
    if tier.bits == 16:
        return _viewed(chunk, torch.float16).float()
    codes_bytes = tier.count * tier.bits // 8
    scale = _viewed(chunk[:, codes_bytes:], SCALE).float()  # (T, 1)
    packed = chunk[:, :codes_bytes]
    if tier.bits == 8:
        codes = packed.view(torch.int8).float()  # same width: a view at any stride
    else:  # each byte's codes at once from a table of every byte value's
        table = _byte_codes(tier.bits, tier.levels).to(chunk.device)
        codes = torch.nn.functional.embedding(packed.long(), table).flatten(-2)
    return codes * scale


@functools.cache
def _byte_codes(bits: int, levels: int) -> torch.Tensor:
    """(256, 8 / bits) float32: the signed codes every byte value packs (:func:`pack_codes`)."""
    return unpack_codes(torch.arange(256, dtype=torch.uint8)[:, None], bits).float() - levels


def _viewed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``t`` (T, n) read as ``dtype``: a view where the layout allows one (a record's
    aligned columns), else a copy."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return _fresh(t).view(dtype)


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in its own storage, row-major: what viewing bytes as another dtype
    needs (a slice of the records keeps their strides and offset)."""
    return t.clone(memory_format=torch.contiguous_format)
