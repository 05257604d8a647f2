"""Small unsigned codes packed several to a byte, lowest bits first (the routing sketch's 4-bit
levels, the offload code's 4- and 2-bit coefficients)."""

from __future__ import annotations

import torch


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., n) in [0, 2**bits) -> uint8 (..., n * bits / 8); bits 2 or 4, n a multiple
    of 8 / bits. The first code of each byte takes its lowest bits."""
    per = 8 // bits
    u = codes.to(torch.uint8).unflatten(-1, (-1, per))
    out = u[..., 0].clone()
    for j in range(1, per):  # one op per code in the byte (a sum over a broadcast is slower)
        out |= u[..., j] << (bits * j)
    return out


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 (..., m) from :func:`pack_codes` -> codes (..., m * 8 / bits) uint8."""
    mask = (1 << bits) - 1  # one elementwise op per code in the byte (faster than a broadcast)
    codes = [(packed >> shift) & mask for shift in range(0, 8, bits)]
    return torch.stack(codes, dim=-1).flatten(-2)
