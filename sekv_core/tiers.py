"""Specs of the offload tier's codes, without torch: settings check them when they are read.

Tier specs (:mod:`sekv_core.codec`):
``"8x8,24x4,32x2"``: the 8 strongest directions at 8 bits, the next 24 at 4, the last 32 at 2;
``"8x8,*x4"``: the 8 strongest at 8 bits, the rest (however many the model's heads have) at 4.
Allocated specs (:mod:`sekv_core.allocated`): ``"alloc:4.5"``, 4.5 bits per number on average,
spread over the directions by the document. Even specs (:mod:`sekv_core.evencode`):
``"even:0.2"``, one step per (layer, KV head), 0.2 of its root-mean-square coefficient.
"""

from __future__ import annotations

from dataclasses import dataclass

BITS = (0, 2, 4, 8, 16)
SCALE_BYTES = 2  # one fp16 scale per row and tier below 16 bits
SPEC_PREFIX = "alloc:"  # sekv_core.allocated's code: "alloc:B", B bits per number on average
MAX_BITS = 8  # its most bits for one direction
EVEN_PREFIX = "even:"  # sekv_core.evencode's code: "even:S", a step of S x the head's rms


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


def parse_alloc(spec: str, dim: int | None = None) -> int | None:
    """Bits per row of an ``alloc:B`` spec for heads of ``dim`` (None: the spec
    is checked as far as it can be without one); None when ``spec`` is not an alloc spec;
    ValueError with a reason when it is one and is malformed."""
    if not spec.startswith(SPEC_PREFIX):
        return None
    text = spec[len(SPEC_PREFIX) :]
    try:
        bits = float(text)
    except ValueError:
        raise ValueError(f"{spec!r}: bits per number must be a number (e.g. alloc:4)") from None
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"{spec!r}: bits per number must be within 1..{MAX_BITS}")
    if dim is None:
        return 0
    row = bits * dim
    if row != int(row) or int(row) % 8:
        raise ValueError(f"{spec!r}: {bits} bits x {dim} numbers is not a whole number of bytes")
    return int(row)


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
    """ValueError with a reason unless ``spec`` is a tier, ``alloc:B`` or ``even:S`` spec."""
    if parse_even(spec) is None and parse_alloc(spec, dim) is None:
        parse_tiers(spec, dim)


def record_bytes(tiers: list[Tier]) -> int:
    """Bytes of one row's record (every tier's codes and scales)."""
    return sum(t.nbytes for t in tiers)
