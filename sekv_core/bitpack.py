"""Unsigned codes packed into bytes: the one bit layout of every packed code in sekv.

A row of codes with widths w_0, w_1, … (0..8 bits each) is one run of bits from the row's
lowest: code j takes bits s_j .. s_j + w_j - 1, s_j = w_0 + … + w_{j-1}, its lowest bit first;
bit b of the run is bit b % 8 of byte b / 8; bits after the last code are 0. A code lies in at
most two adjacent bytes. The routing sketch's 4-bit levels, the offload codes' records (an even
code's direction widths, a tier code's 4-bit codes) and the entropy coder's fields are laid out
so; the C code reads and writes them through ``native/bitfields.h``, which follows this layout.
"""

from __future__ import annotations

import functools
import math

import torch


def pack_codes(
    codes: torch.Tensor, widths: int | torch.Tensor, nbytes: int | None = None
) -> torch.Tensor:
    """Codes (..., n), each below 2**width, -> uint8 (..., nbytes) rows.

    widths : one width for every code (2, 4 or 8, n * width a multiple of 8), or (n,) int64
        each code's width; nbytes : the rows' bytes (default: the codes' bits, rounded up)."""
    if isinstance(widths, int):
        per = 8 // widths
        u = codes.to(torch.uint8).unflatten(-1, (-1, per))
        out = u[..., 0].clone()
        for j in range(1, per):  # one op per code in the byte (a sum over a broadcast is slower)
            out |= u[..., j] << (widths * j)
        return out
    B, widths = _row_bytes(widths, nbytes), widths.to(codes.device)
    starts = torch.cumsum(widths, 0) - widths
    first = (starts // 8).clamp(max=max(B - 1, 0))  # a 0-bit code after the last byte: any
    shift = (starts - 8 * first).to(torch.int32)
    placed = codes.to(torch.int32) << shift  # (..., n): the code over its first byte, < 2^16
    out = codes.new_zeros((*codes.shape[:-1], B + 1), dtype=torch.int32)
    out.scatter_add_(-1, first.expand_as(placed), placed & 255)  # codes share no bit: a sum
    out.scatter_add_(-1, (first + 1).expand_as(placed), placed >> 8)  # is their union
    return out[..., :B].to(torch.uint8)


def unpack_codes(packed: torch.Tensor, widths: int | torch.Tensor) -> torch.Tensor:
    """uint8 rows (..., B) from :func:`pack_codes` -> uint8 codes (..., n): B * 8 / width codes
    for one width; for (n,) widths one code per width, on the rows' device, laid out code-major
    (a transposed view: each code's column is one run, as a product reads it). ``widths`` are
    read on the host (keep them on the CPU): their places are cached per layout."""
    if isinstance(widths, int):
        mask = (1 << widths) - 1  # one op per code in the byte (faster than a broadcast)
        codes = [(packed >> shift) & mask for shift in range(0, 8, widths)]
        return torch.stack(codes, dim=-1).flatten(-2)
    lead, B = packed.shape[:-1], packed.shape[-1]
    first, shift, mask = _fields(tuple(widths.tolist()), B, packed.device)
    T = math.prod(lead)
    # byte-major (B, T): picking a code's bytes is then a copy of whole rows of T
    rows = torch.empty((max(B, 2), T), dtype=torch.int16, device=packed.device)
    rows[:B].copy_(packed.reshape(T, B).t())
    if B < 2:  # a one-byte row: its 16-bit window runs past it
        rows[B:] = 0
    # (B - 1, T) the 16-bit window from each byte on (int16 wraps: the mask drops the sign)
    windows = torch.bitwise_left_shift(rows[1:], 8).bitwise_or_(rows[:-1])
    codes = windows.index_select(0, first).bitwise_right_shift_(shift).bitwise_and_(mask)
    return codes.to(torch.uint8).t().view(*lead, first.numel())  # (n, T) in memory


@functools.lru_cache(maxsize=256)
def _fields(
    widths: tuple[int, ...], nbytes: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each code of a row of ``nbytes`` lies: its 16-bit window's first byte (n,) int64 (a
    code in the row's last byte: the window of the last two), its first bit in that window and
    its mask (n, 1) int16. Cached per layout: a store's few layouts decode many times."""
    w = torch.tensor(widths, dtype=torch.int64)
    starts = torch.cumsum(w, 0) - w
    first = (starts // 8).clamp(max=max(nbytes, 2) - 2)  # a 0-bit code after the last: any
    shift = torch.where(w > 0, starts - 8 * first, 0)
    mask = (1 << w) - 1
    return (
        first.to(device),
        shift[:, None].to(device, torch.int16),
        mask[:, None].to(device, torch.int16),
    )


def _row_bytes(widths: torch.Tensor, nbytes: int | None) -> int:
    """A row's bytes: ``nbytes``, or the codes' bits rounded up; ValueError if they do not fit."""
    bits = int(widths.sum())
    B = -(-bits // 8) if nbytes is None else nbytes
    if 8 * B < bits:
        raise ValueError(f"codes of {bits} bits do not fit in {B} bytes")
    return B
