"""Specs of the offload tier's two codes, checked without torch: settings
(:mod:`sekv_core.config`) read them early, below the store that codes by them.

- Keys: ``"even:S"`` — one even grid per (layer, KV head) on the document's directions, its
  step S times the head's root-mean-square coefficient (:class:`~sekv_core.store.codes.EvenCode`).
- Values: ``"*x4"`` — every direction at 4 bits with one fp16 scale per row
  (:class:`~sekv_core.store.codes.TierCode`).
- Either kind: ``"*x16"`` — fp16 coefficients, lossless up to fp16 (a store whose zoomed spans
  are the document's own rows: the exactness checks).
"""

from __future__ import annotations

from typing import Literal

SCALE_BYTES = 2  # a 4-bit record's one fp16 scale
MAX_BITS = 8  # an even code's most bits for one direction
EVEN_PREFIX = "even:"
LOSSLESS = "*x16"
TIER_BITS = {"*x4": 4, LOSSLESS: 16}  # a tier code's spec -> its bits per direction
ACCEPTED = {"key": "even:S (e.g. even:0.175) or *x16", "value": "*x4 or *x16"}


def parse_even(spec: str) -> float | None:
    """The relative step of an ``even:S`` spec; None when ``spec`` is not one; ValueError with
    a reason when it is one and is malformed."""
    if not spec.startswith(EVEN_PREFIX):
        return None
    try:
        step = float(spec[len(EVEN_PREFIX) :])
    except ValueError:
        raise ValueError(f"{spec!r}: the step must be a number (e.g. even:0.2)") from None
    if not 0.01 <= step <= 4:
        raise ValueError(f"{spec!r}: the step must be within 0.01..4 (x the head's rms)")
    return step


def tier_bits(spec: str) -> int:
    """The bits per direction of a tier code's ``spec``; ValueError unless it is one."""
    if spec not in TIER_BITS:
        raise ValueError(f"{spec!r} is not a tier code (*x4 or *x16)")
    return TIER_BITS[spec]


def check_code(spec: str, kind: Literal["key", "value"]) -> None:
    """ValueError with a reason unless ``spec`` is a code of ``kind``."""
    step = parse_even(spec)
    if spec == LOSSLESS or (step is not None if kind == "key" else spec in TIER_BITS):
        return
    raise ValueError(f"{spec!r} is not a {kind} code: use {ACCEPTED[kind]}")


def tier_record_bytes(bits: int, dim: int) -> int:
    """Bytes of one row's record in a tier code of ``bits`` over ``dim`` directions."""
    return 2 * dim if bits == 16 else dim * bits // 8 + SCALE_BYTES
