"""The sketch's fixes: what turns the rows rebuilt from the decoded keys into the build's rows.

A rebuilt sketch number lands on another level than the build's only where it lies near a
level's boundary: the key code's error is a few hundredths of a level. So the fixes are coded
against that nearness, which a load computes too. Every rebuilt number ``x`` is ranked by its
distance to the nearest boundary (in 1/64 level buckets below a quarter level; layer by layer,
the flat order within a bucket), and a fix that moves it one level across that boundary (the
direction its nearness implies: up when it lies above its level) is one position in that
ranking. The positions are stored as the gaps between them (varints): near the boundary fixes
are dense and the gaps short. The rest — a number moved by more than a level, or away from its
nearest boundary, or ranked out — are listed in flat order as before (:func:`fix_tensors`).
Both lists share one LZMA stream. On the lighthouse story's store (a tenth of the sketch's
numbers moved) that is 4.1 bits per fix, where the flat list took 6.1 and the nearness alone
would give 3.6 (the entropy of a fix in each 1/200-level bucket).

Both sides compute the ranking from the same rebuilt numbers (:mod:`sekv_core.sketch_rebuild`:
the same operations on the same stored tensors, on one thread).
"""

from __future__ import annotations

import numpy as np
import torch

from .packed import deflated, inflated

FIX_GAP = 32767  # the longest step between flat fixes a uint16 holds beside the fix's sign
NEAR = 0.25  # numbers this near a boundary (in levels) are ranked; farther ones rarely move
BUCKETS = 16  # buckets of nearness below NEAR: 1/64 level each


def ranking(raw: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranked numbers of the rebuilt sketch ``raw`` (L, ..., unrounded levels): their flat
    indices, nearest a boundary first (layer by layer), and each number's implied fix (+1 or
    -1, flat, float32)."""
    clamped = raw.clamp(-top, top)
    frac = (clamped - clamped.round()).flatten()  # within ±0.5: above or below its level
    implied = torch.where(frac > 0, 1.0, -1.0)
    near = 0.5 - frac.abs()  # distance to the nearest boundary, in levels
    ranked = torch.nonzero(near < NEAR).flatten()
    bucket = (near[ranked] * (BUCKETS / NEAR)).long().clamp_(max=BUCKETS - 1)
    layer = ranked // (raw.numel() // raw.shape[0])
    key = (layer * BUCKETS + bucket).numpy().astype(np.uint32)
    return torch.from_numpy(ranked.numpy()[np.argsort(key, kind="stable")]), implied


def encode_fixes(raw: torch.Tensor, built: torch.Tensor, top: int) -> torch.Tensor:
    """The fixes (one LZMA stream, uint8) that turn the rebuilt ``raw`` numbers (unrounded),
    rounded and clamped to ±``top``, into the built levels ``built`` (same shape)."""
    levels = raw.round().clamp(-top, top)
    delta = (built.float() - levels).flatten()
    order, implied = ranking(raw, top)
    moved = (delta[order] == implied[order]).numpy()  # one level across the near boundary
    positions = np.flatnonzero(moved)
    rest = delta.clone()
    rest[order[torch.from_numpy(positions)]] = 0
    gaps = np.diff(positions, prepend=-1) - 1  # (the first: from the start)
    flat = fix_tensors(rest)["sketch_fixes"].numpy().tobytes()
    blob = _varints(np.array([len(gaps)])) + _varints(gaps) + flat
    return deflated(blob)


def decode_fixes(raw: torch.Tensor, packed: torch.Tensor, top: int) -> torch.Tensor:
    """The built levels (float32, ``raw``'s shape) from the rebuilt numbers ``raw`` and their
    fixes (:func:`encode_fixes`); ValueError where the fixes do not fit them."""
    blob = inflated(packed, "the sketch's fixes")
    values, used = _read_varints(blob)  # the count, then the gaps
    flat = blob[used:]
    if len(flat) % 2:
        raise ValueError("the sketch's flat fixes are not uint16")
    levels = raw.round().clamp(-top, top)
    order, implied = ranking(raw, top)
    positions = np.cumsum(values[1:] + 1) - 1
    if len(positions) and positions[-1] >= len(order):
        raise ValueError("a sketch fix lies beyond the ranked numbers")
    where = order[torch.from_numpy(positions)]
    levels.view(-1).index_add_(0, where, implied[where])
    if flat:
        apply_fixes(levels, torch.frombuffer(bytearray(flat), dtype=torch.uint16))
    return levels


def fix_tensors(delta: torch.Tensor) -> dict[str, torch.Tensor]:
    """The flat fixes of the level differences ``delta`` (any shape; mostly zeros), one uint16
    each: the step from the previous fix (the first: from 0) in flat order, twice, plus 1 for
    +1 (0: -1). A difference of d is |d| fixes at one number; a step longer than FIX_GAP puts a
    +1 and a -1 FIX_GAP on, as often as needed."""
    flat = delta.flatten().round().long()
    where = torch.nonzero(flat).flatten()
    count = flat[where].abs()
    where, up = where.repeat_interleave(count), (flat[where] > 0).repeat_interleave(count)
    gaps = torch.diff(where, prepend=where.new_zeros(1))
    pairs = torch.div(gaps - 1, FIX_GAP, rounding_mode="floor").clamp(min=0)
    if int(pairs.sum()):  # each pair: +1 after FIX_GAP, -1 after 0
        size = 2 * pairs + 1
        at = torch.repeat_interleave(torch.arange(len(gaps)), size)
        within = torch.arange(len(at)) - (torch.cumsum(size, 0) - size)[at]
        last = within == 2 * pairs[at]
        gaps = torch.where(last, gaps[at] - pairs[at] * FIX_GAP, (within % 2 == 0) * FIX_GAP)
        up = torch.where(last, up[at], within % 2 == 0)
    return {"sketch_fixes": (gaps * 2 + up).to(torch.int32).to(torch.uint16)}


def apply_fixes(levels: torch.Tensor, fixes: torch.Tensor) -> None:
    """Add the flat fixes (:func:`fix_tensors`) to ``levels`` in place; ValueError if they do
    not fit it."""
    if fixes.dim() != 1 or fixes.dtype != torch.uint16:
        raise ValueError("the sketch's fixes are not a flat uint16 list")
    if fixes.numel():
        code = fixes.long()
        where = torch.cumsum(code >> 1, 0)
        if int(where[-1]) >= levels.numel():
            raise ValueError("a sketch fix lies beyond the sketch")
        levels.view(-1).index_add_(0, where, ((code & 1) * 2 - 1).float())


def _varints(values: np.ndarray) -> bytes:
    """Non-negative integers as LEB128 varints: 7 bits a byte, the high bit set on all but a
    number's last byte."""
    v = np.asarray(values, dtype=np.uint64)
    if not len(v):
        return b""
    size = np.ones(len(v), dtype=np.int64)
    for k in range(1, 10):
        size += v >= np.uint64(1) << np.uint64(7 * k)
    start = np.cumsum(size) - size
    out = np.zeros(int(size.sum()), dtype=np.uint8)
    for k in range(int(size.max())):
        has = size > k
        byte = (v[has] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (size[has] > k + 1).astype(np.uint64) << np.uint64(7)
        out[start[has] + k] = (byte | more).astype(np.uint8)
    return out.tobytes()


def _read_varints(blob: bytes) -> tuple[np.ndarray, int]:
    """The varints at the start of ``blob`` — its first says how many follow it — and the
    bytes they take; ValueError where they are cut short."""
    data = np.frombuffer(blob, dtype=np.uint8)
    last = np.flatnonzero(data < 0x80)  # each varint's last byte
    if not len(last):
        raise ValueError("the sketch's ranked fixes are not whole")
    count = int(_values(data[: last[0] + 1], last[:1])[0])
    if count + 1 > len(last):
        raise ValueError("the sketch's ranked fixes are not whole")
    ends = last[: count + 1]
    return _values(data[: ends[-1] + 1], ends), int(ends[-1]) + 1


def _values(data: np.ndarray, ends: np.ndarray) -> np.ndarray:
    starts = np.concatenate([[0], ends[:-1] + 1])
    if int((ends - starts).max(initial=0)) > 9:
        raise ValueError("the sketch's ranked fixes are not whole")
    group = np.repeat(np.arange(len(ends)), ends - starts + 1)
    shift = (np.arange(len(data)) - starts[group]).astype(np.uint64) * np.uint64(7)
    parts = (data.astype(np.uint64) & np.uint64(0x7F)) << shift
    return np.add.reduceat(parts, starts).astype(np.int64)
