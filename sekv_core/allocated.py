"""An offload code that spends a fixed number of bits per row where the document needs them.

Fitted over the document (a book: its first window), per (layer, KV head):

- a *metric*: how strongly the queries weigh each dimension. Attention reads a key through
  ``q·k``, so a key's error costs in proportion to the queries' energy along it; RoPE turns each
  pair of dimensions (i, i + D/2) by position, so the pair shares the mean of its two energies.
  Values get no metric (ones).
- the principal directions of the rows in that metric (centred), strongest first, and each
  direction's range over the document;

and per layer (its heads share it) a *bit allocation* over the directions: greedily, the next
bit goes where it removes the most squared error of the document's own rows (0 bits drops a
direction; a kept one has 2 to 8 bits, its codes on an even grid over its range). Strong
directions get many bits, weak ones none.

A row's record is its codes' bits packed one after another: every row the same size (the spec's
bits per number), so a span decodes alone, at token resolution, in a few batched operations
(:meth:`AllocatedCode.decode`). Spec: ``"alloc:4"``, 4 bits per number on average.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from . import kernels
from .narrow import narrowed
from .summary import STORE_DTYPE, stored
from .tiers import MAX_BITS

RIDGE = 1e-4  # the metric's floor, a share of its largest dimension (no direction is free)
ALLOCATION_ROWS = 1024  # at most about this many rows per head weigh the bit allocation


def query_metric(moment: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Per (layer, KV head) dimension weights (L, H, D) of pre-RoPE keys from the queries'
    second moment (L, H, D, D) (None: ones, as for values)."""
    L, H, _, D = like.shape
    if moment is None:
        return like.new_ones(L, H, D, dtype=torch.float)
    energy = moment.float().diagonal(dim1=-2, dim2=-1)  # (L, H, D)
    half = D // 2
    pair = (energy[..., :half] + energy[..., half:]) / 2  # RoPE turns (i, i + D/2) together
    metric = torch.cat([pair, pair], dim=-1)
    metric = metric / metric.amax(dim=-1, keepdim=True).clamp(min=1e-30)  # only ratios matter
    return metric.clamp(min=RIDGE)


@dataclass
class AllocatedCode:
    """Per (layer, KV head): ``basis`` (L, H, D, D) directions of the rows in the metric
    (columns strongest first; half precision, so decoded with its inverse), ``metric``, row
    ``mean`` and direction ``range`` (L, H, D); ``bits`` (L, H, D) int, the same for a layer's
    heads, each summing to at most ``row_bits``."""

    basis: torch.Tensor
    metric: torch.Tensor
    mean: torch.Tensor
    range: torch.Tensor
    bits: torch.Tensor
    row_bits: int
    step: torch.Tensor | None = None  # (L, H): an even code's step per head (sekv_core.evencode)

    @classmethod
    def fit(cls, rows: torch.Tensor, row_bits: int, metric: torch.Tensor) -> AllocatedCode:
        """The code of rows (L, H, S, D) in ``metric`` (L, H, D) at ``row_bits`` per row."""
        x, metric = rows.float(), stored(metric)
        L, H, S, D = x.shape
        if S == 0:  # no rows: any code of the right shape
            eye = torch.eye(D).expand(L, H, D, D).contiguous()
            bits = _allocate(x.new_zeros(L, D, MAX_BITS + 1), row_bits)
            zeros, ones = x.new_zeros(L, H, D), x.new_ones(L, H, D)
            return cls(eye, metric, zeros, ones, bits[:, None].expand(L, H, D), row_bits)
        mean = stored(x.mean(dim=2))
        scale = metric.sqrt()
        bases, ranges, errors = [], [], []
        for layer in range(L):  # one layer at a time: bounded working memory
            basis, coef = metric_directions(x[layer], mean[layer], scale[layer])
            span = stored(coef.abs().amax(dim=1).clamp(min=1e-6))  # (H, D)
            bases.append(basis)
            ranges.append(span)
            sample = coef[:, :: max(1, S // ALLOCATION_ROWS)]
            errors.append(_errors(sample, span).sum(dim=0))  # the layer's heads share a layout
        bits = _allocate(torch.stack(errors), row_bits)[:, None].expand(L, H, D)
        return cls(torch.stack(bases), metric, mean, torch.stack(ranges), bits, row_bits)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            f"{prefix}_basis": self.basis.to(STORE_DTYPE),
            f"{prefix}_metric": self.metric.to(STORE_DTYPE),
            f"{prefix}_mean": self.mean.to(STORE_DTYPE),
            f"{prefix}_range": self.range.to(STORE_DTYPE),
            f"{prefix}_bits": self.bits.to(torch.uint8).contiguous(),
            **({} if self.step is None else {f"{prefix}_step": self.step.to(STORE_DTYPE)}),
        }

    @classmethod
    def from_tensors(
        cls, tensors: dict[str, torch.Tensor], prefix: str, row_bits: int
    ) -> AllocatedCode:
        return cls(
            tensors[f"{prefix}_basis"].float(),
            tensors[f"{prefix}_metric"].float(),
            tensors[f"{prefix}_mean"].float(),
            tensors[f"{prefix}_range"].float(),
            tensors[f"{prefix}_bits"].long(),
            row_bits,
            tensors[f"{prefix}_step"].float() if f"{prefix}_step" in tensors else None,
        )

    @property
    def record_bytes(self) -> int:
        return self.row_bits // 8

    @cached_property
    def grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each direction's step and largest code (L, H, D) (codes -levels .. levels)."""
        levels = torch.where(self.bits >= 2, 2 ** (self.bits - 1).clamp(min=1) - 1, 0).float()
        return self.range / levels.clamp(min=1), levels

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Records (L, H, S, B) uint8 of rows (L, H, S, D), one layer at a time."""
        return torch.stack([self.encode_layer(rows[i], i) for i in range(rows.shape[0])])

    def encode_layer(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        """Records (H, S, B) uint8 of one layer's rows (H, S, D): each code offset to be
        non-negative, its bits (lowest first) after the previous direction's. In float
        arithmetic, exact on these integers: a code times 2^offset splits into the part in its
        first byte and the part in the next; codes never share a bit, so each byte is the sum
        of the parts it holds (one product per part)."""
        step, levels = (t[layer][:, None] for t in self.grid)
        y = (rows.float() - self.mean[layer][:, None]) * self.metric[layer].sqrt()[:, None]
        codes = ((y @ self.basis[layer]) / step).round().clamp(-levels, levels) + levels
        low_bytes, high_bytes, shift = (t[layer] for t in self.places)
        placed = codes * shift  # (H, S, D): the code over its first byte, < 2^16
        high = torch.floor(placed * (1 / 256))
        low = torch.addcmul(placed, high, torch.tensor(256.0), value=-1.0)
        return (low @ low_bytes + high @ high_bytes).to(torch.uint8)

    @cached_property
    def places(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per layer the maps (L, D, B) from each code's part in its first byte and in the
        next to the record's bytes, and 2^offset (L, D), the code's first bit in its byte."""
        windows, _, _ = self.fields  # (L, B + 1, D): first byte 2^-offset, next 256 x that
        first = windows.transpose(1, 2)[..., :-1]  # (L, D, B): the spare byte holds nothing
        low_bytes = (first > 0) & (first < 1.5)  # 2^-offset <= 1 marks the first byte
        high_bytes = first >= 1.5  # 256 x 2^-offset >= 2 marks the next
        bits = self.bits[:, 0]
        starts = torch.cumsum(bits, dim=-1) - bits
        used = (bits > 0)[:, :, None]
        shift = 2.0 ** (starts % 8).float()
        return (low_bytes & used).float(), (high_bytes & used).float(), shift

    def decode(
        self, records: torch.Tensor, layer: int, heads: torch.Tensor | list[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows (T, D) in ``dtype`` of records (T, B) uint8 of one layer, ``heads`` (T,) their
        KV heads, ascending (or each head's rows, :func:`per_head`). In float arithmetic, exact
        on these small integers, every row at once (a layer's heads share a layout): one
        product puts each code's two bytes, over 2^offset, in its column, two floors cut the
        code out; then one product per head maps the codes to rows."""
        if records.dtype == torch.uint8 and kernels.usable(records):  # one call on the CPU
            codes = kernels.field_codes(records, self.layer_bits[layer])
        else:
            windows, narrow, width = (t[layer] for t in self.fields)
            # code + bits above it; the spare byte after the record (always 0) adds nothing
            field = records.float() @ windows[:-1]
            above = torch.floor(field * narrow)
            codes = torch.addcmul(field, above, width, value=-1.0).floor_()  # (T, D), >= 0
        maps, bias = self.synthesis
        return per_head(codes, heads, maps[layer], bias[layer]).to(dtype)

    def record_fields(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A record's bit fields per layer (:mod:`sekv_core.rans`): widths (L, F), each
        direction's code (0: dropped) then the record's unused bits, and flips (none)."""
        bits = self.layer_bits
        spare = 8 * self.record_bytes - bits.sum(dim=1)  # (L,) bits after the last code
        pads = [(spare - 8 * i).clamp(0, 8)[:, None] for i in range(-(-int(spare.max()) // 8))]
        widths = torch.cat([bits, *pads], dim=1)
        return widths.contiguous(), torch.zeros_like(widths)

    @cached_property
    def layer_bits(self) -> torch.Tensor:
        """(L, D) int64 each direction's bits per layer (a layer's heads share a layout)."""
        return self.bits[:, 0].long().contiguous()

    @cached_property
    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each direction's code lies in a record, per layer: the map (L, B + 1, D) from
        the record's bytes to each code's 16-bit window (its first byte + 256 x the next) over
        2^offset (the code's first bit in that byte), 2^-bits and 2^bits (L, D)."""
        bits = self.bits[:, 0]  # (L, D)
        L, D = bits.shape
        starts = torch.cumsum(bits, dim=-1) - bits
        first = (starts // 8).clamp(max=self.record_bytes - 1)  # 0-bit ends: any byte
        shift = 2.0 ** -(starts - 8 * first).float()  # (L, D)
        windows = torch.zeros(L, self.record_bytes + 1, D)
        windows.scatter_(1, first[:, None], shift[:, None])
        windows.scatter_(1, first[:, None] + 1, 256 * shift[:, None])
        width = 2.0 ** bits.float()
        return windows, 1.0 / width, width

    @cached_property
    def synthesis(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per (layer, head) the map (L, H, D, D) from a row's codes to its row, and the row
        its all-zero codes stand for (L, H, D): the mean less each direction's offset."""
        step, levels = self.grid
        back = torch.linalg.inv(self.basis) * self.metric.rsqrt()[..., None, :]  # (L, H, D, D)
        maps = step[..., None] * back  # the row of one code unit of each direction
        bias = self.mean - (levels[..., None] * maps).sum(dim=2)
        return maps.contiguous(), bias


def metric_directions(
    rows: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's rows (H, S, D), centred on ``mean`` and scaled by ``scale`` (H, D): their
    principal directions (H, D, D), strongest first as a store keeps them (exact in fp16), and
    the rows' coefficients on them (H, S, D)."""
    y = (rows - mean[:, None]) * scale[:, None]
    _, vecs = torch.linalg.eigh(y.transpose(-1, -2) @ y)
    basis = narrowed(vecs.flip(-1))
    return basis, y @ basis


def per_head(
    coef: torch.Tensor,
    heads: torch.Tensor | list[int],
    maps: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """Rows (T, D) of coefficients (T, C) grouped by KV head (``heads``: (T,) each row's head,
    ascending, or the rows of each head as a list): one product per head with its map
    (H, C, D), plus its bias (H, D), written in place. Both offload codes end so."""
    if not isinstance(heads, list):
        heads = torch.bincount(heads.cpu(), minlength=maps.shape[0]).tolist()
    out = coef.new_empty(coef.shape[0], maps.shape[-1])
    at = 0
    for h, n in enumerate(heads):
        if n:
            torch.addmm(bias[h], coef[at : at + n], maps[h], out=out[at : at + n])
            at += n
    return out


def _errors(coef: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Squared error (H, D, MAX_BITS + 1) of each direction's coefficients (H, S, D) at each
    bit count (1 bit: not a code here, never chosen), summed over the rows."""
    out = [coef.square().sum(dim=1)]  # 0 bits: the coefficient dropped
    for bits in range(1, MAX_BITS + 1):
        levels = max(2 ** (bits - 1) - 1, 1)
        step = span[:, None] / levels
        q = (coef / step).round().clamp(-levels, levels) * step
        out.append(((coef - q).square().sum(dim=1)) if bits > 1 else out[0] * 2)
    return torch.stack(out, dim=-1)


def _allocate(errors: torch.Tensor, budget: int) -> torch.Tensor:
    """Bits (P, D) for every group p of directions, each summing to at most ``budget``:
    greedily the move (a direction's next bit count) that removes the most error per bit."""
    P, D, _ = errors.shape
    bits = torch.zeros(P, D, dtype=torch.long)
    left = torch.full((P,), budget, dtype=torch.long)
    rows = torch.arange(P)
    while True:
        nxt = torch.where(bits == 0, 2, bits + 1)
        cost = nxt - bits
        ok = (nxt <= MAX_BITS) & (cost <= left[:, None])
        now = errors.gather(2, bits[..., None])[..., 0]
        then = errors.gather(2, nxt.clamp(max=MAX_BITS)[..., None])[..., 0]
        gain = torch.where(ok, (now - then) / cost, -1.0)
        best = gain.argmax(dim=1)
        active = gain[rows, best] >= 0
        if not bool(active.any()):
            return bits
        pick = rows[active], best[active]
        left[active] -= cost[pick]
        bits[pick] = nxt[pick]
