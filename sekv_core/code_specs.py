"""Specs of the offload tier's two codes, checked without torch: settings
(:mod:`sekv_core.config`) read them early, below the store that codes by them.

Keys: ``"even:S"`` — one even grid per (layer, KV head) on the document's directions, its step
S times the head's root-mean-square coefficient (:class:`~sekv_core.store.codes.EvenCode`).
Values: tier specs — ``"*x4"`` (every direction at 4 bits) or ``"8x8,24x4,32x2"`` (the 8
strongest directions at 8 bits, the next 24 at 4, the last 32 at 2); 16 bits keeps fp16
coefficients, 0 drops the directions (:class:`~sekv_core.store.codes.TierCode`). Either spec
fits either kind.
"""

from __future__ import annotations

from dataclasses import dataclass

BITS = (0, 2, 4, 8, 16)
SCALE_BYTES = 2  # one fp16 scale per row and tier below 16 bits
MAX_BITS = 8  # an even code's most bits for one direction
EVEN_PREFIX = "even:"


@dataclass(frozen=True)
class Tier:
    count: int  # directions
    bits: int

    @property
    def nbytes(self) -> int:
        """Bytes of one row's tier: codes (and its scale below 16 bits)."""
        if self.bits == 0:
            return 0
        codes = self.count * self.bits // 8
        return codes if self.bits == 16 else codes + SCALE_BYTES

    @property
    def levels(self) -> int:
        """Largest code magnitude (codes are symmetric: -levels .. levels)."""
        return 1 if self.bits == 2 else 2 ** (self.bits - 1) - 1


def parse_tiers(spec: str, dim: int | None = None) -> list[Tier]:
    """Tiers of ``spec`` ("COUNTxBITS,..."; the last COUNT may be ``*``: the directions left),
    resolved for heads of ``dim`` directions when given (else checked as far as it can be);
    ValueError with a reason otherwise."""
    items = [item.strip() for item in spec.split(",")]
    tiers: list[Tier] = []
    for n, item in enumerate(items):
        count, _, bits = item.partition("x")
        rest = count == "*"
        if not ((count.isdigit() or rest) and bits.isdigit()):
            raise ValueError(f"tier {item!r} is not COUNTxBITS (e.g. 16x8, or *x4: the rest)")
        if rest and n != len(items) - 1:
            raise ValueError(f"tier {item!r}: only the last tier can take the rest (*)")
        if int(bits) not in BITS:
            raise ValueError(f"tier {item!r}: bits must be one of {', '.join(map(str, BITS))}")
        fixed = sum(t.count for t in tiers)
        if rest and dim is None:
            continue  # resolved once the head size is known
        tier = Tier(dim - fixed if rest else int(count), int(bits))
        if dim is not None and (fixed + max(tier.count, 0) > dim or tier.count < 0):
            raise ValueError(f"tiers {spec!r} name more directions than the model's heads' {dim}")
        if (not rest and tier.count < 1) or tier.count * tier.bits % 8:
            raise ValueError(f"tier {item!r}: {tier.count} directions do not fill whole bytes")
        if tier.count:
            tiers.append(tier)
    if dim is None:
        if not any(int(item.partition("x")[2]) for item in items):
            raise ValueError(f"tiers {spec!r} keep no direction")
        return tiers
    covered = sum(t.count for t in tiers)
    if covered != dim:
        raise ValueError(f"tiers {spec!r} cover {covered} directions; the model's heads have {dim}")
    if not any(t.bits for t in tiers):
        raise ValueError(f"tiers {spec!r} keep no direction")
    return tiers


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


def check_code(spec: str, dim: int | None = None) -> None:
    """ValueError with a reason unless ``spec`` is a tier or ``even:S`` spec."""
    if parse_even(spec) is None:
        parse_tiers(spec, dim)


def record_bytes(tiers: list[Tier]) -> int:
    """Bytes of one row's record (every tier's codes and scales)."""
    return sum(t.nbytes for t in tiers)
