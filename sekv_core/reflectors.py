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
OCTAVE = 4  # a grid's step is 2^(e / OCTAVE): a quarter octave apart, the codes span ±107..127
MIN_EXP = -24 * OCTAVE  # an all-zero reflector's (the last one: nothing below the diagonal)
MAX_EXP = -6 * OCTAVE  # entries within [-1, 1]: 127 x 2^-6 covers them


def reflected(vecs: torch.Tensor) -> torch.Tensor:
    """The stored form int8 (..., D, D) of orthonormal columns ``vecs`` (..., D, D): each
    reflector's codes below the diagonal, its grid's exponent on it.

    A QR factorisation one reflector at a time, each rounded before the next is found: the next
    reflector is fitted to what the rounded ones left (their product's error is not passed on
    to every later direction, as rounding geqrf's reflectors after the fact would)."""
    a = vecs.detach().cpu().double().clone()
    out = torch.zeros_like(a)
    D = a.shape[-1]
    for i in range(D - 1):  # (the last direction follows from the others, up to its sign)
        x = a[..., i:, i]
        alpha, norm = x[..., 0], x.norm(dim=-1)
        gap = alpha + torch.where(alpha >= 0, norm, -norm)  # |alpha| + |x|: no cancellation
        tail = x[..., 1:] / torch.where(norm > 0, gap, 1.0)[..., None]  # (x = 0: none)
        peak = tail.abs().amax(dim=-1, keepdim=True) / LEVELS
        exp = torch.ceil(torch.log2(peak) * OCTAVE).clamp(MIN_EXP, MAX_EXP)
        codes = (tail / _step(exp)).round().clamp(-LEVELS, LEVELS)
        out[..., i + 1 :, i], out[..., i, i] = codes, exp[..., 0]
        v = torch.cat([torch.ones_like(alpha)[..., None], codes * _step(exp)], dim=-1)
        tau = 2.0 / v.square().sum(dim=-1)  # the reflection a load makes of these codes
        block = a[..., i:, i:]
        block -= (tau[..., None] * v)[..., :, None] * (v[..., None, :] @ block)
    out[..., D - 1, D - 1] = MIN_EXP
    return out.to(torch.int8).to(vecs.device)


def rotation(reflectors: torch.Tensor) -> torch.Tensor:
    """The directions (..., D, D) float32 (fp16 numbers) the stored form ``reflectors`` makes:
    the product of its reflections, in float64; ValueError where it is not a stored form."""
    check(reflectors)
    r = reflectors.cpu().double()
    exp = r.diagonal(dim1=-2, dim2=-1)  # (..., D)
    tails = r.tril(-1) * _step(exp)[..., None, :]
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


def _step(exp: torch.Tensor) -> torch.Tensor:
    """A grid's step (float64) of its exponent, in :data:`OCTAVE` parts of an octave."""
    return torch.exp2(exp / OCTAVE)
