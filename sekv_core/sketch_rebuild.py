"""The routing sketch's rows, rebuilt when a store is loaded from the keys of its offload tier.

A sketch row is a projection of one span token's key (:mod:`sekv_core.sketch`), and the
offload tier already holds every span key in the key code. So the store on disk keeps the
sketch's fixed-size parts (its query and key directions, the mean key, one scale per direction)
and no rows: at load every span key is decoded, rotated to its position (a bounded store's
sketch is of pre-RoPE keys), projected and quantised at the stored scale. That costs each
load about 0.08 s per thousand tokens on one CPU thread, so a store of more than
:data:`REBUILT_TOKENS` span tokens (a long book) keeps its rows: at 64K tokens every question
would wait seconds.

A decoded key is not the exact key, and about one sketch number in twenty lies so near a
level's boundary that the key code's error moves it to the next level. Under tight memory
targets routing is sensitive to such moves, so the build also rebuilds the rows this way and
stores the differences to its own rows as *fixes*: one uint16 per level moved, the distance
from the previous fix and the direction, LZMA-compressed. Loading applies them, and the rows
are exactly those the build made from the exact keys. At about two fixes per span token and
KV head (the default model), that is ~1.6 bytes where the rows took 16 (a 32-direction 4-bit
sketch).

Both sides run the same operations on the same stored tensors, on one thread (a product's
summation order depends on the threads; a rounding moved by it would make a fix wrong).
"""

from __future__ import annotations

import lzma
from dataclasses import dataclass

import torch

from .codec import load_code
from .rope import Rope
from .sketch import dequantize_sketch, pack_sketch, span_token_positions
from .summary import one_thread

REBUILT_TOKENS = 16384  # the most span tokens whose sketch rows are rebuilt (~1.3 s)
FIX_GAP = 32767  # the longest step between fixes a uint16 holds beside the fix's sign


def rebuilds(span_tokens: int) -> bool:
    """Whether a store of ``span_tokens`` keeps fixes and rebuilds its sketch rows at load
    (else it keeps the rows)."""
    return span_tokens <= REBUILT_TOKENS


@dataclass
class SpanKeys:
    """A store's span keys as its offload tier holds them, and what the sketch is made of.

    resident : the store's resident tensors (span bounds, ``part_rows``, the key code's
    codebooks, ``sketch_key``, ``sketch_mean``, ``sketch_scale``; loaded: ``sketch_fixes``;
    built: ``sketch``); parts : each part's flat key records (L, H, rows, record); code : the
    key code's spec; rope : rotates keys to their positions (None: the sketch is of pre-RoPE
    keys, a bounded store's); bits : the sketch's."""

    resident: dict[str, torch.Tensor]
    parts: list[torch.Tensor]
    code: str
    rope: Rope | None
    bits: int


def rebuilt_sketch(keys: SpanKeys) -> torch.Tensor:
    """The packed sketch (L, H, S, R / 2 or R) of a store: rebuilt from its keys, its fixes
    applied (the rows the build made)."""
    levels = rebuilt_levels(keys)
    apply_fixes(levels, unpacked_fixes(keys.resident["sketch_fixes"]))
    return pack_sketch(levels, keys.bits)


def sketch_fixes(keys: SpanKeys) -> dict[str, torch.Tensor]:
    """The fixes (``sketch_fixes``) that turn the sketch rebuilt from the keys into the built
    ``sketch``; none (an empty dict: the store keeps the rows) where they would not take
    fewer bytes than the rows."""
    built = keys.resident["sketch"].cpu()
    dim = keys.resident["sketch_key"].shape[-1]
    fixes = fix_tensors(dequantize_sketch(built, dim, torch.float32) - rebuilt_levels(keys))
    packed = packed_fixes(fixes["sketch_fixes"])
    return {"sketch_fixes": packed} if packed.nbytes < built.nbytes else {}  # else: the rows


def packed_fixes(fixes: torch.Tensor) -> torch.Tensor:
    """The fixes (uint16, :func:`fix_tensors`) as a store keeps them: LZMA-compressed bytes
    (uint8). Their steps are short and alike, so they take ~0.4 of their uint16 bytes (the
    entropy of the steps, ~6.3 bits per fix with its sign)."""
    return torch.frombuffer(bytearray(lzma.compress(fixes.numpy().tobytes())), dtype=torch.uint8)


def unpacked_fixes(packed: torch.Tensor) -> torch.Tensor:
    """The fixes (uint16) of :func:`packed_fixes`; ValueError if they are not such bytes."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError("the sketch's fixes are not packed bytes")
    try:
        raw = lzma.decompress(packed.numpy().tobytes())
    except lzma.LZMAError as exc:
        raise ValueError(f"the sketch's fixes do not unpack ({exc})") from None
    if len(raw) % 2:
        raise ValueError("the sketch's fixes are not uint16")
    if not raw:
        return torch.zeros(0, dtype=torch.uint16)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint16)


def fix_tensors(delta: torch.Tensor) -> dict[str, torch.Tensor]:
    """The fixes of the level differences ``delta`` (any shape; mostly zeros), one uint16 each:
    the step from the previous fix (the first: from 0) in flat order, twice, plus 1 for +1
    (0: -1). A difference of d is |d| fixes at one number; a step longer than FIX_GAP puts a
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
    """Add the fixes (:func:`fix_tensors`) to ``levels`` in place; ValueError if they do not
    fit it."""
    if fixes.dim() != 1 or fixes.dtype != torch.uint16:
        raise ValueError("the sketch's fixes are not a flat uint16 list")
    if fixes.numel():
        code = fixes.long()
        where = torch.cumsum(code >> 1, 0)
        if int(where[-1]) >= levels.numel():
            raise ValueError("a sketch fix lies beyond the sketch")
        levels.view(-1).index_add_(0, where, ((code & 1) * 2 - 1).float())


def rebuilt_levels(source: SpanKeys) -> torch.Tensor:
    """Sketch levels (L, H, S, R) float32 of the decoded span keys (no fixes)."""
    resident, rope = source.resident, source.rope
    code = load_code(resident, "k", source.code)
    scale = resident["sketch_scale"].float().cpu()  # (L, H, R)
    proj = resident["sketch_key"].float() / scale[:, :, None]  # (L, H, D, R), in levels
    offset = resident["sketch_mean"].float().cpu()[:, :, None] @ proj  # (L, H, 1, R)
    L, H, _, R = proj.shape
    rows_per_part = torch.diff(resident["part_rows"]).tolist()
    S = sum(rows_per_part)
    positions = span_token_positions(resident["span_starts"], resident["span_ends"]).repeat(H)
    top = 2 ** (source.bits - 1) - 1
    records = [part.view(-1, code.record_bytes) for part in source.parts]
    out = torch.zeros(L, H, S, R)
    if not S:
        return out
    with one_thread():
        for layer in range(L):  # one layer at a time: bounded working memory
            picked = [  # a part's records of a layer: (H, n, record), every head's rows in order
                part[layer * H * n : (layer + 1) * H * n].view(H, n, code.record_bytes)
                for part, n in zip(records, rows_per_part, strict=True)
            ]
            rows = picked[0] if len(picked) == 1 else torch.cat(picked, dim=1)
            keys = code.decode(rows.reshape(H * S, -1), layer, [S] * H, torch.float32)
            if rope is not None:
                keys = rope.rotate(keys, positions)
            sketch = torch.baddbmm(offset[layer], keys.view(H, S, -1), proj[layer], beta=-1)
            out[layer] = sketch.round_().clamp_(-top, top)  # (k - mu) B / scale
    return out


def key_parts(flat: torch.Tensor, part_rows: torch.Tensor) -> list[torch.Tensor]:
    """The parts' flat key records (views) of a store's one flat ``k_rows`` buffer: a part of
    n rows holds n rows' records of every layer and head."""
    per_row = flat.numel() // max(int(part_rows[-1]), 1)
    bounds = (part_rows * per_row).tolist()
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
