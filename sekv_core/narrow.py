"""The offload code's bases in 8 bits: each column (one direction) of a (layer, KV head)'s
basis on a power-of-two grid of its own, codes in ±127.

Fitting rounds the directions to that grid before anything uses them (:func:`narrowed`), so a
build codes with exactly the numbers a load reads back: a code of at most 7 bits
times a power of two is exact in half precision. The file holds the codes (int8) and one
exponent per column (int8) where the numbers took fp16 (:func:`narrow`; half the bytes), and a
load widens them back to those fp16 numbers, bit for bit (:func:`widen`).

The rounding moves a direction by ~0.3% of its largest entry: rows are coded and decoded with
the rounded directions, which decorrelate them as well as before. The routing sketch's two
projections stay in fp16: under tight memory targets routing turns on small differences in
them (rounded the same way, they cost the training-free router one to two answers of 27 per
memory target; docs/history/compact-store-study.md).
"""

from __future__ import annotations

import torch

from .summary import STORE_DTYPE

NARROWED = ("k_basis", "v_basis")  # (L, H, D, D) each
LEVELS = 127
MIN_EXP = -24  # half precision's smallest step: every grid point stays exact in fp16
EXP = "_exp"  # suffix of a narrowed matrix's exponents (L, H, 1, C)


def _grid(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (..., D, C) and each column's grid exponent (..., 1, C) of ``t``: the least e with
    max |column| <= 127 * 2^e (zero columns: MIN_EXP), the codes rounded on 2^e."""
    t = t.float()
    exp = torch.ceil(torch.log2(t.abs().amax(dim=-2, keepdim=True) / LEVELS)).clamp(min=MIN_EXP)
    return (t / torch.exp2(exp)).round().clamp(-LEVELS, LEVELS), exp


def narrowed(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., D, C) float32 with each column rounded to its grid: the numbers a store
    keeps (exact in fp16; narrowing them again changes nothing)."""
    codes, exp = _grid(t)
    return codes * torch.exp2(exp)


def narrow(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` as a store's file holds them: each of :data:`NARROWED` there as int8 codes
    and its columns' exponents (``name + EXP``, int8)."""
    out = dict(tensors)
    for name in NARROWED:
        if name in out:
            codes, exp = _grid(out[name])
            out[name], out[name + EXP] = codes.to(torch.int8), exp.to(torch.int8)
    return out


def widen(tensors: dict[str, torch.Tensor]) -> None:
    """The matrices :func:`narrow` stored, back in fp16, in place; ValueError where one is not
    codes and exponents of its shape."""
    for name in NARROWED:
        if name not in tensors:
            continue
        codes, exp = tensors[name], tensors.pop(name + EXP, None)
        if codes.dtype != torch.int8 or exp is None or exp.dtype != torch.int8:
            raise ValueError(f"{name} is not stored as 8-bit codes and exponents")
        if exp.shape != (*codes.shape[:-2], 1, codes.shape[-1]):
            raise ValueError(f"{name}'s exponents do not fit its codes")
        tensors[name] = (codes.float() * torch.exp2(exp.float())).to(STORE_DTYPE)
