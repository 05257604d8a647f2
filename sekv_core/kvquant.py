"""How K/V numbers are kept: the store's half precision (:data:`STORE_DTYPE`, :func:`stored`),
and 8-bit K/V rows, how an answer holds token-level K/V on the device (zoomed spans, sinks,
anchors) between decoding steps.

Each row (one token's key or value for one KV head) keeps int8 codes and one fp16 scale, its
largest magnitude / 127: D + 2 bytes instead of 2·D in fp16. Attention reads the rows back in
the model dtype, one layer at a time. The rounding error of a value is at most half a step,
``scale / 2`` (why 8 bits: docs/design.md).
:class:`Rows` also holds fp16 rows (16 bits): the streamed ingest attends to what it stores at
that precision.
"""

from __future__ import annotations

import torch

STORE_DTYPE = torch.float16  # what the store keeps in half precision
KV_BITS = 8  # how answers hold token-level K/V on the device
CACHE_DTYPE = STORE_DTYPE  # 16-bit rows: half precision
LEVELS = 127
SCALE_DTYPE = torch.float16


def resident_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The precision of a store's floats held beside a model of ``model_dtype``: the model's own
    when it is half precision or less, else :data:`STORE_DTYPE`."""
    return model_dtype if model_dtype.itemsize <= 2 else STORE_DTYPE


def stored(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a store keeps it (half precision), in float32: a code is fitted, encoded and
    decoded with the same numbers."""
    return t.to(STORE_DTYPE).float()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes (same shape as ``x``) and fp16 scales (``x.shape[:-1]``), one per last-dim row."""
    amax = x.detach().abs().amax(dim=-1)  # a new tensor: the steps below work in place
    scale = amax.float().div_(LEVELS).to(SCALE_DTYPE)
    step = scale.float().clamp_(min=torch.finfo(SCALE_DTYPE).tiny)  # all-zero rows: any step
    codes = x.float().div(step[..., None]).round_().clamp_(-LEVELS, LEVELS).to(torch.int8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows in ``dtype`` from :func:`quantize_rows`' codes and scales."""
    return codes.to(dtype) * scale.to(dtype)[..., None]


def quantized(bits: int) -> bool:
    """Whether rows at ``bits`` are int8 codes + scales (8) rather than fp16 (16)."""
    if bits not in (8, 16):
        raise ValueError(f"K/V bits must be 8 or 16, not {bits}")
    return bits == 8


def row_bytes(dim: int, bits: int) -> int:
    """Bytes one row of ``dim`` numbers costs at ``bits`` (8: codes + scale; 16: fp16)."""
    return dim + SCALE_DTYPE.itemsize if quantized(bits) else 2 * dim


class Rows:
    """K or V rows as an answer holds them on the device: fp16 (16 bits), or int8 codes with one
    fp16 scale per row (8 bits). codes (..., n, D); scale (..., n) or None."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor | None) -> None:
        self.codes, self.scale = codes, scale

    @classmethod
    def encode(cls, x: torch.Tensor, bits: int) -> Rows:
        return cls(*quantize_rows(x)) if quantized(bits) else cls(x.to(CACHE_DTYPE), None)

    @classmethod
    def empty(cls, shape: tuple[int, ...], dim: int, bits: int, device: torch.device) -> Rows:
        """Zero rows (*shape, dim) to :meth:`put` rows into."""
        if not quantized(bits):
            return cls(torch.zeros(*shape, dim, dtype=CACHE_DTYPE, device=device), None)
        codes = torch.zeros(*shape, dim, dtype=torch.int8, device=device)
        return cls(codes, torch.zeros(shape, dtype=SCALE_DTYPE, device=device))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors holding the rows (to count their bytes)."""
        return [self.codes] if self.scale is None else [self.codes, self.scale]

    def layer(self, i: int) -> Rows:
        """Block ``i`` of rows (views)."""
        return Rows(self.codes[i], None if self.scale is None else self.scale[i])

    def put(self, index: tuple, rows: Rows) -> None:
        """Write ``rows`` at ``index`` of the rows' leading dimensions (as tensor indexing)."""
        self.codes[index] = rows.codes
        if self.scale is not None:
            self.scale[index] = rows.scale

    def pad(self, extra: int) -> None:
        """Append ``extra`` zero rows to each block of (..., n, D) rows."""
        self.codes = torch.nn.functional.pad(self.codes, (0, 0, 0, extra))
        if self.scale is not None:
            self.scale = torch.nn.functional.pad(self.scale, (0, extra))

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The rows in ``dtype`` (dequantized)."""
        if self.scale is None:
            return self.codes.to(dtype)
        return dequantize_rows(self.codes, self.scale, dtype)
