"""8-bit K/V rows: what a zoomed token costs while it waits between decoding steps.

Each row (one token's key or value for one KV head) keeps int8 codes and one fp16 scale, its
largest magnitude / 127: D + 2 bytes instead of 2·D in fp16. Attention reads the rows back in
the model dtype, one layer at a time. The rounding error of a value is at most half a step,
``scale / 2`` (measured on the default model, every span zoomed: see docs/benchmarks.md).
"""

from __future__ import annotations

import torch

LEVELS = 127
SCALE_DTYPE = torch.float16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes (same shape as ``x``) and fp16 scales (``x.shape[:-1]``), one per last-dim row."""
    amax = x.detach().abs().amax(dim=-1).float()
    scale = (amax / LEVELS).to(SCALE_DTYPE)
    step = scale.float().clamp(min=torch.finfo(SCALE_DTYPE).tiny)  # all-zero rows: any step
    codes = (x.float() / step[..., None]).round().clamp(-LEVELS, LEVELS).to(torch.int8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows in ``dtype`` from :func:`quantize_rows`' codes and scales."""
    return (codes.to(dtype) * scale.to(dtype)[..., None]).to(dtype)


def row_bytes(dim: int, bits: int) -> int:
    """Bytes one row of ``dim`` numbers costs at ``bits`` (8: codes + scale; 16: fp16)."""
    if bits == 8:
        return dim + SCALE_DTYPE.itemsize
    if bits == 16:
        return 2 * dim
    raise ValueError(f"zoom bits must be 8 or 16, not {bits}")
