"""The offload tier's codes: every span token's pre-RoPE key and value in a few bits per number.

Both codes are fitted over the document (a book: over its first window of tokens) per
(layer, KV head): the principal directions of the centred rows (``basis`` (L, H, D, D),
columns strongest first), the rows' ``mean`` and each direction's ``range``. A basis is kept
in 8 bits: each column on a power-of-two grid of its own (:func:`on_grid`), int8 codes and one
exponent per column on disk, so build and load use the same numbers.
A row is coded as its coefficients on those directions; its *record* is a fixed number of
bytes, so a span's rows of one (layer, head) are one range of the tier and decode alone.

- :class:`EvenCode` (keys, ``"even:S"``): in the queries' metric (attention reads a key
  through ``q·k``, so a key's error costs in proportion to the queries' energy along it), one
  even grid per head, its step S times the head's rms coefficient; each direction gets the
  bits (2..8, shared by a layer's heads; 0 drops it) that hold its largest code, so no row is
  clipped. Records are the codes packed one after another (:mod:`sekv_core.bitpack`).
- :class:`TierCode` (values, ``"*x4"``): every direction at 4 bits with one fp16 scale per row
  (its largest magnitude), so small rows keep their relative error; ``"*x16"``: fp16
  coefficients (lossless, either kind).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

import torch

from ..bitpack import pack_codes, unpack_codes
from ..code_specs import MAX_BITS, parse_even, tier_bits, tier_record_bytes
from ..errors import SekvError
from ..kvquant import STORE_DTYPE, stored
from ..native import kernels

SCALE = torch.float16  # a 4-bit record's row scale (code_specs.SCALE_BYTES)
TIER_LEVELS = 7  # a 4-bit tier code's codes lie in ±TIER_LEVELS
RIDGE = 1e-4  # the key metric's floor, a share of its largest dimension (no direction is free)
LEVELS = 127  # a basis column's codes lie in ±LEVELS
MIN_EXP = -24  # half precision's smallest step: every grid point is exact in fp16


def query_metric(moment: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Per (layer, KV head) dimension weights (L, H, D) of pre-RoPE keys from the queries'
    second moment (L, H, D, D) (None: ones). RoPE turns each pair (i, i + D/2) by position,
    so the pair shares the mean of its two energies."""
    L, H, _, D = like.shape
    if moment is None:
        return like.new_ones(L, H, D, dtype=torch.float)
    energy = moment.float().diagonal(dim1=-2, dim2=-1)  # (L, H, D)
    half = D // 2
    pair = (energy[..., :half] + energy[..., half:]) / 2
    metric = torch.cat([pair, pair], dim=-1)
    metric = metric / metric.amax(dim=-1, keepdim=True).clamp(min=1e-30)  # only ratios matter
    return metric.clamp(min=RIDGE)


def directions(rows: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor | None = None):
    """One layer's rows (H, S, D) centred on ``mean`` (H, D) and scaled by ``scale`` (H, D):
    their principal directions (H, D, D) strongest first, as stored (fp16 numbers), and the
    rows' coefficients on them (H, S, D)."""
    y = rows - mean[:, None]
    if scale is not None:
        y = y * scale[:, None]
    _, vecs = torch.linalg.eigh(y.transpose(-1, -2) @ y)
    basis = on_grid(vecs.flip(-1)).contiguous()
    return basis, y @ basis


def _grid(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (..., D, C) and each column's exponent (..., 1, C) of ``t``: the least e with
    max |column| <= 127 * 2^e (zero columns: MIN_EXP), the codes rounded on 2^e."""
    t = t.float()
    exp = torch.ceil(torch.log2(t.abs().amax(dim=-2, keepdim=True) / LEVELS)).clamp(min=MIN_EXP)
    return (t / torch.exp2(exp)).round().clamp(-LEVELS, LEVELS), exp


def on_grid(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., D, C) float32 with each column rounded to its 8-bit grid: the numbers a
    store keeps (rounding them again changes nothing)."""
    codes, exp = _grid(t)
    return codes * torch.exp2(exp)


def basis_tensors(prefix: str, basis: torch.Tensor) -> dict[str, torch.Tensor]:
    """A basis on its grid as the file holds it: ``{prefix}_basis`` int8 codes and
    ``{prefix}_basis_exp`` int8 exponents (..., 1, C)."""
    codes, exp = _grid(basis)
    return {f"{prefix}_basis": codes.to(torch.int8), f"{prefix}_basis_exp": exp.to(torch.int8)}


def read_basis(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The basis :func:`basis_tensors` stored, float32; ValueError where it is malformed."""
    codes, exp = tensors[f"{prefix}_basis"], tensors[f"{prefix}_basis_exp"]
    if codes.dtype != torch.int8 or exp.dtype != torch.int8 or codes.dim() != 4:
        raise ValueError(f"{prefix}_basis is not 8-bit codes with exponents")
    if exp.shape != (*codes.shape[:-2], 1, codes.shape[-1]):
        raise ValueError(f"{prefix}_basis's exponents do not fit its codes")
    return codes.float() * torch.exp2(exp.float())


class RowCode:
    """What both codes share: rows coded one layer at a time (each code's ``_encode_layer``),
    records decoded to codes (its ``_codes``), then per head through its ``synthesis``."""

    synthesis: tuple[torch.Tensor, torch.Tensor]  # (L, H, C, D) maps and (L, H, D) biases

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Records (L, H, S, B) uint8 of rows (L, H, S, D), one layer at a time."""
        return torch.stack([self._encode_layer(rows[i], i) for i in range(rows.shape[0])])

    def decode(
        self,
        records: torch.Tensor,
        layer: int,
        heads: torch.Tensor | list[int],
        dtype: torch.dtype,
        then: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Rows (T, D) in ``dtype`` of records (T, B) uint8 of one layer, ``heads`` (T,) their
        KV heads, ascending (or each head's row count, as :func:`per_head` takes them);
        ``then``: an affine map (H, D, R), (H, R) applied to each head's rows (T, R). The codes
        read (one native call on the CPU), then one product per head."""
        maps, bias = self.synthesis[0][layer], self.synthesis[1][layer]  # (H, C, D), (H, D)
        if then is not None:  # one product per head from codes to the mapped rows
            bias = torch.baddbmm(then[1][:, None], bias[:, None], then[0])[:, 0]
            maps = maps @ then[0]
        return per_head(self._codes(records, layer), heads, maps, bias).to(dtype)


@dataclass
class TierCode(RowCode):
    """Directions ``basis`` (L, H, D, D), row ``mean`` and direction ``range`` (L, H, D),
    float32 holding fp16 numbers; ``bits`` per direction: 4 (codes and a row scale) or 16
    (fp16 coefficients)."""

    basis: torch.Tensor
    mean: torch.Tensor
    range: torch.Tensor
    bits: int

    @classmethod
    def fit(cls, rows: torch.Tensor, bits: int) -> TierCode:
        """The code of rows (L, H, S, D), one layer at a time (bounded working memory)."""
        x = rows.float()
        L, H, S, D = x.shape
        if S == 0:  # no span tokens: any code of the right shape
            eye = torch.eye(D).expand(L, H, D, D).contiguous()
            return cls(eye, x.new_zeros(L, H, D), x.new_ones(L, H, D), bits)
        mean = stored(x.mean(dim=2))
        bases, spans = [], []
        for layer in range(L):
            basis, coef = directions(x[layer], mean[layer])
            bases.append(basis)
            spans.append(coef.abs().amax(dim=1).clamp(min=1e-6))
        return cls(torch.stack(bases), mean, stored(torch.stack(spans)), bits)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        names = {"mean": self.mean, "range": self.range}
        out = {f"{prefix}_{n}": t.to(STORE_DTYPE).contiguous() for n, t in names.items()}
        return {**basis_tensors(prefix, self.basis), **out}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str, spec: str) -> TierCode:
        basis = read_basis(tensors, prefix)
        mean, span = tensors[f"{prefix}_mean"].float(), tensors[f"{prefix}_range"].float()
        return cls(basis, mean, span, tier_bits(spec))

    @cached_property
    def record_bytes(self) -> int:
        return tier_record_bytes(self.bits, self.basis.shape[-1])

    def _encode_layer(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        """Records (H, S, B): fp16 coefficients, or 4-bit codes (offset by TIER_LEVELS to be
        non-negative, packed) then the row's fp16 scale (its largest magnitude / TIER_LEVELS)."""
        centred = rows.float() - self.mean[layer][:, None]
        coef = (centred @ self.basis[layer]) / self.range[layer][:, None]  # (H, S, D)
        if self.bits == 16:
            return _fresh(coef.to(torch.float16)).view(torch.uint8)
        scale = (coef.abs().amax(dim=-1, keepdim=True) / TIER_LEVELS).to(SCALE)
        step = scale.float().clamp(min=torch.finfo(SCALE).tiny)
        codes = (coef / step).round().clamp(-TIER_LEVELS, TIER_LEVELS) + TIER_LEVELS
        return torch.cat([pack_codes(codes, 4), _fresh(scale).view(torch.uint8)], dim=-1)

    def _codes(self, records: torch.Tensor, layer: int) -> torch.Tensor:
        if records.dtype == torch.uint8 and kernels.usable(records):
            return kernels.tier_coefficients(records, self.bits, self.basis.shape[-1])
        return self.coefficients(records)

    def coefficients(self, records: torch.Tensor) -> torch.Tensor:
        """Coefficients (T, D) float32 of records (T, B)."""
        if self.bits == 16:
            return _viewed(records, torch.float16).float()
        half = self.basis.shape[-1] // 2
        scale = _viewed(records[:, half:], SCALE).float()  # (T, 1)
        table = _byte_codes().to(records.device)  # each byte's two codes at once
        codes = torch.nn.functional.embedding(records[:, :half].long(), table).flatten(-2)
        return codes * scale

    def record_fields(self) -> torch.Tensor:
        """A record's bit fields' widths (L, F), the same in every layer: each code, then the
        scale's two bytes (fp16 coefficients: two bytes each)."""
        D = self.basis.shape[-1]
        widths = [8, 8] * D if self.bits == 16 else [4] * D + [8, 8]
        return torch.tensor(widths, dtype=torch.int64).expand(self.basis.shape[0], -1).contiguous()

    @cached_property
    def synthesis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (layer, head) the map (L, H, D, D) from coefficients back to rows — the inverse
        of the fp16 directions (nearly, not exactly, orthonormal), ranges folded in — and the
        rows' mean (L, H, D)."""
        return (self.range[..., None] * torch.linalg.inv(self.basis)).contiguous(), self.mean


@dataclass
class EvenCode(RowCode):
    """Per (layer, KV head): ``basis`` (L, H, D, D) directions of the rows in the ``metric``
    (L, H, D), row ``mean`` and direction ``range`` (L, H, D) (the grid's largest code times
    its step); ``bits`` (L, H, D) int, the same for a layer's heads, summing to at most
    ``row_bits``."""

    basis: torch.Tensor
    metric: torch.Tensor
    mean: torch.Tensor
    range: torch.Tensor
    bits: torch.Tensor
    row_bits: int

    @classmethod
    def fit(cls, rows: torch.Tensor, relative_step: float, metric: torch.Tensor) -> EvenCode:
        """The code of rows (L, H, S, D), its step ``relative_step`` times each head's rms
        coefficient; a direction that would need more than 8 bits keeps 8 on a grid over its
        range."""
        x, metric = rows.float(), stored(metric)
        L, H, S, D = x.shape
        if S == 0:  # no rows: any code of the right shape (one byte of unused bits)
            eye = torch.eye(D).expand(L, H, D, D).contiguous()
            zeros, ones = x.new_zeros(L, H, D), x.new_ones(L, H, D)
            bits = torch.zeros(L, H, D, dtype=torch.long)
            return cls(eye, metric, zeros, ones, bits, 8)
        mean = stored(x.mean(dim=2))
        scale = metric.sqrt()
        bases, peaks, steps, needed, bits = [], [], [], [], []
        for layer in range(L):  # one layer at a time: bounded working memory
            basis, coef = directions(x[layer], mean[layer], scale[layer])
            step = relative_step * coef.square().mean(dim=(1, 2)).sqrt().clamp(min=1e-6)  # (H,)
            peak = coef.abs().amax(dim=1)  # (H, D)
            levels = torch.ceil(peak / step[:, None] - 0.5).clamp(min=0)  # largest code needed
            need = torch.where(levels > 0, torch.log2(2 * levels + 1).ceil().clamp(min=2), 0.0)
            bases.append(basis)
            peaks.append(peak)
            steps.append(step)
            needed.append(levels)
            bits.append(need.amax(dim=0).clamp(max=MAX_BITS).long())  # (D,) the heads' layout
        layout = torch.stack(bits)[:, None].expand(L, H, D)
        step, peak = torch.stack(steps), torch.stack(peaks)
        top = torch.where(layout >= 2, 2 ** (layout - 1).clamp(min=1) - 1, 0).float()
        fits = top >= torch.stack(needed)
        span = stored(torch.where(fits, top * step[..., None], peak).clamp(min=1e-6))
        basis = torch.stack(bases)
        return cls(basis, metric, mean, span, layout, _row_bits(layout))

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        names = {"metric": self.metric, "mean": self.mean, "range": self.range}
        out = {f"{prefix}_{n}": t.to(STORE_DTYPE).contiguous() for n, t in names.items()}
        out.update(basis_tensors(prefix, self.basis))
        out[f"{prefix}_bits"] = self.bits.to(torch.uint8).contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> EvenCode:
        bits = tensors[f"{prefix}_bits"].long()
        if bits.dim() != 3 or bool((bits > MAX_BITS).any()):
            raise ValueError(f"{prefix}_bits is not a layout of 0..{MAX_BITS} bits (L, H, D)")
        return cls(
            read_basis(tensors, prefix),
            tensors[f"{prefix}_metric"].float(),
            tensors[f"{prefix}_mean"].float(),
            tensors[f"{prefix}_range"].float(),
            bits,
            _row_bits(bits),
        )

    @property
    def record_bytes(self) -> int:
        return self.row_bits // 8

    @cached_property
    def grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each direction's step and largest code (L, H, D) (codes -levels .. levels)."""
        levels = torch.where(self.bits >= 2, 2 ** (self.bits - 1).clamp(min=1) - 1, 0).float()
        return self.range / levels.clamp(min=1), levels

    def _encode_layer(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        """Records (H, S, B) of one layer's rows (H, S, D): each code offset to be
        non-negative, packed in its direction's bits (:func:`~sekv_core.bitpack.pack_codes`)."""
        step, levels = (t[layer][:, None] for t in self.grid)
        y = (rows.float() - self.mean[layer][:, None]) * self.metric[layer].sqrt()[:, None]
        codes = ((y @ self.basis[layer]) / step).round().clamp(-levels, levels) + levels
        return pack_codes(codes.to(torch.int32), self.layer_bits[layer], self.record_bytes)

    def _codes(self, records: torch.Tensor, layer: int) -> torch.Tensor:
        if records.dtype == torch.uint8 and kernels.usable(records):
            return kernels.field_codes(records, self.layer_bits[layer])
        return unpack_codes(records, self.layer_bits[layer]).float()

    def record_fields(self) -> torch.Tensor:
        """A record's bit fields' widths per layer (L, F): each direction's code (0: dropped),
        then the record's unused bits."""
        bits = self.layer_bits
        spare = 8 * self.record_bytes - bits.sum(dim=1)  # (L,) bits after the last code
        pads = [(spare - 8 * i).clamp(0, 8)[:, None] for i in range(-(-int(spare.max()) // 8))]
        return torch.cat([bits, *pads], dim=1).contiguous()

    @cached_property
    def layer_bits(self) -> torch.Tensor:
        """(L, D) int64 each direction's bits per layer (a layer's heads share a layout)."""
        return self.bits[:, 0].long().contiguous()

    @cached_property
    def synthesis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (layer, head) the map (L, H, D, D) from a row's codes to its row, and the row
        its all-zero codes stand for (L, H, D): the mean less each direction's offset."""
        step, levels = self.grid
        back = torch.linalg.inv(self.basis) * self.metric.rsqrt()[..., None, :]
        maps = step[..., None] * back  # the row of one code unit of each direction
        bias = self.mean - (levels[..., None] * maps).sum(dim=2)
        return maps.contiguous(), bias


Code = TierCode | EvenCode


def fit_code(
    rows: torch.Tensor, spec: str, setting: str = "code", moment: torch.Tensor | None = None
) -> Code:
    """The code of ``spec`` (:mod:`sekv_core.code_specs`) fitted to rows (L, H, S, D);
    ``moment`` (L, H, D, D): the queries' second moment that weighs an even code's dimensions
    (None: equal weights). SekvError naming ``setting`` for a spec that is not a code."""
    try:
        step = parse_even(spec)
        bits = tier_bits(spec) if step is None else 0
    except ValueError as exc:
        raise SekvError(f"{setting}: {exc}") from None
    if step is not None:
        return EvenCode.fit(rows, step, query_metric(moment, rows))
    return TierCode.fit(rows, bits)


def load_code(tensors: dict[str, torch.Tensor], prefix: str, spec: str) -> Code:
    """The code of ``spec`` from its stored tensors (``prefix``: ``k`` or ``v``)."""
    if parse_even(spec) is not None:
        return EvenCode.from_tensors(tensors, prefix)
    return TierCode.from_tensors(tensors, prefix, spec)


def store_codebooks(
    tensors: dict[str, torch.Tensor], key_code: str, value_code: str
) -> dict[str, Code]:
    """A store's offload codes (``k``, ``v``) from its tensors at its settings' specs."""
    return {"k": load_code(tensors, "k", key_code), "v": load_code(tensors, "v", value_code)}


def per_head(
    coef: torch.Tensor,
    heads: torch.Tensor | list[int],
    maps: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """Rows (T, D) of coefficients (T, C) grouped by KV head (``heads``: (T,) each row's head,
    ascending, or the row count of each head): one product per head with its map (H, C, D),
    plus its bias (H, D), written in place."""
    if not isinstance(heads, list):
        heads = torch.bincount(heads.cpu(), minlength=maps.shape[0]).tolist()
    out = coef.new_empty(coef.shape[0], maps.shape[-1])
    at = 0
    for h, n in enumerate(heads):
        if n:
            torch.addmm(bias[h], coef[at : at + n], maps[h], out=out[at : at + n])
            at += n
    return out


def _row_bits(bits: torch.Tensor) -> int:
    """A record's bits for the layout ``bits`` (L, H, D): the widest layer's, in whole bytes."""
    widest = int(bits[:, 0].sum(dim=-1).max()) if bits.numel() else 0
    return max(8, -(-widest // 8) * 8)


@cache
def _byte_codes() -> torch.Tensor:
    """(256, 2) float32: the signed 4-bit codes every byte value packs (:func:`pack_codes`)."""
    return unpack_codes(torch.arange(256, dtype=torch.uint8)[:, None], 4).float() - TIER_LEVELS


def _viewed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``t`` (T, n) read as ``dtype``: a view where the layout allows one, else a copy."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return _fresh(t).view(dtype)


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy of ``t`` in its own storage (viewing bytes as another dtype needs it)."""
    return t.clone(memory_format=torch.contiguous_format)
