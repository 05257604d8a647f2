"""The offload code's bases stored as rotations: each (layer, KV head)'s directions as the
Householder reflectors that make them, in 8 bits.

A basis is D orthonormal directions: D x D numbers, of which only D(D-1)/2 are free. Its QR
factorisation (LAPACK's ``geqrf``) writes it as D - 1 reflections, the i-th one's vector
holding D - 1 - i numbers below the diagonal (each entry within [-1, 1]). A store keeps those
numbers, each reflector on a power-of-two grid of its own (codes ±127, the grid's exponent on
the diagonal, where geqrf's own layout has an implied 1): int8 (..., D, D), its upper triangle
empty — half the numbers of the directions themselves, and the upper half packs to almost
nothing.

The product of the rounded reflections (each with its exact ``tau = 2 / v.v``) is exactly
orthogonal whatever the rounding did; it only turns the directions slightly off the document's
principal ones (by ~1° on average). Fitting uses that product (:func:`rotation`, rounded to
fp16) before anything codes a row with it, and a load computes the same product from the same
codes, so a build and a load code and decode with the same directions. The product runs in
float64 and is rounded to fp16: the summation order of a thread count or machine cannot move
that rounding in practice.
"""

from __future__ import annotations

import torch

from .summary import stored

BASES = ("k_basis", "v_basis")  # a store's codebooks' bases: int8 (L, H, D, D) each
LEVELS = 127
MIN_EXP = -24  # an all-zero reflector's (the last one: nothing below the diagonal)
MAX_EXP = -6  # entries within [-1, 1]: 127 x 2^-6 covers them


def reflected(vecs: torch.Tensor) -> torch.Tensor:
    """The stored form int8 (..., D, D) of orthonormal columns ``vecs`` (..., D, D): each
    reflector's codes below the diagonal, its grid's exponent on it."""
    a, _ = torch.geqrf(vecs.detach().cpu().double())
    tails = a.tril(-1)
    peak = tails.abs().amax(dim=-2, keepdim=True) / LEVELS  # (..., 1, D)
    exp = torch.ceil(torch.log2(peak)).clamp(MIN_EXP, MAX_EXP)
    codes = (tails / torch.exp2(exp)).round().clamp(-LEVELS, LEVELS)
    out = codes + torch.diag_embed(exp[..., 0, :])
    return out.to(torch.int8).to(vecs.device)


def rotation(reflectors: torch.Tensor) -> torch.Tensor:
    """The directions (..., D, D) float32 (fp16 numbers) the stored form ``reflectors`` makes:
    the product of its reflections, in float64; ValueError where it is not a stored form."""
    check(reflectors)
    r = reflectors.cpu().double()
    exp = r.diagonal(dim1=-2, dim2=-1)  # (..., D)
    tails = r.tril(-1) * torch.exp2(exp)[..., None, :]
    tau = 2.0 / (1.0 + tails.square().sum(dim=-2))  # exactly orthogonal reflections
    return stored(torch.linalg.householder_product(tails, tau)).to(reflectors.device)


def directions(vecs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored form of ``vecs`` (:func:`reflected`) and the directions it makes
    (:func:`rotation`): what a code is fitted with."""
    reflectors = reflected(vecs)
    return reflectors, rotation(reflectors)


def check(reflectors: torch.Tensor) -> None:
    """ValueError unless ``reflectors`` is a stored form: int8 (..., D, D), nothing above the
    diagonal, exponents on it within the grid's."""
    shape = reflectors.shape
    if reflectors.dtype != torch.int8 or len(shape) < 2 or shape[-1] != shape[-2]:
        raise ValueError("a basis is not stored as 8-bit reflectors")
    exp = reflectors.diagonal(dim1=-2, dim2=-1)
    if bool(reflectors.triu(1).any()) or bool(((exp < MIN_EXP) | (exp > MAX_EXP)).any()):
        raise ValueError("a basis's reflectors are malformed")


def check_bases(tensors: dict[str, torch.Tensor]) -> None:
    """ValueError unless each of :data:`BASES` in ``tensors`` is a stored form (named)."""
    for name in BASES:
        if name in tensors:
            try:
                check(tensors[name])
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
