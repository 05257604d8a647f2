"""The routing sketch's rows, rebuilt when a store is loaded from the keys of its offload tier.

A sketch row is a projection of one span token's key (:mod:`sekv_core.sketch`), and the
offload tier already holds every span key in the key code. So the store on disk keeps the
sketch's fixed-size parts (its query and key directions, the mean key, one scale per direction)
and no rows: at load every span key is decoded, rotated to its position (a bounded store's
sketch is of pre-RoPE keys), projected and quantised at the stored scale. That costs each
load about 0.08 s per thousand tokens on one CPU thread, so a store of more than
:data:`REBUILT_TOKENS` span tokens (a long book) keeps its rows: at 64K tokens every question
would wait seconds.

A decoded key is not the exact key, and about one sketch number in ten lies so near a level's
boundary that the key code's error moves it to the next level. Under tight memory targets
routing is sensitive to such moves, so the build also rebuilds the rows this way and stores
the differences to its own rows as *fixes*, coded against each rebuilt number's nearness to a
boundary (:mod:`sekv_core.sketch_fixes`). Loading applies them, and the rows are exactly those
the build made from the exact keys. At about three fixes per span token and KV head (the
default model's keys), that is ~1.7 bytes where the rows took 16 (a 32-direction 4-bit
sketch).

Both sides run the same operations on the same stored tensors, on one thread (a product's
summation order depends on the threads; a rounding moved by it would make a fix wrong).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codec import load_code
from .rope import Rope
from .sketch import dequantize_sketch, pack_sketch, span_token_positions
from .sketch_fixes import decode_fixes, encode_fixes
from .summary import one_thread

REBUILT_TOKENS = 16384  # the most span tokens whose sketch rows are rebuilt (~1.3 s)


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
    top = 2 ** (keys.bits - 1) - 1
    levels = decode_fixes(rebuilt_numbers(keys), keys.resident["sketch_fixes"], top)
    return pack_sketch(levels, keys.bits)


def sketch_fixes(keys: SpanKeys) -> dict[str, torch.Tensor]:
    """The fixes (``sketch_fixes``, :mod:`sekv_core.sketch_fixes`) that turn the sketch rebuilt
    from the keys into the built ``sketch``; none (an empty dict: the store keeps the rows)
    where they would not take fewer bytes than the rows."""
    built = keys.resident["sketch"].cpu()
    dim = keys.resident["sketch_key"].shape[-1]
    top = 2 ** (keys.bits - 1) - 1
    levels = dequantize_sketch(built, dim, torch.float32)
    packed = encode_fixes(rebuilt_numbers(keys), levels, top)
    return {"sketch_fixes": packed} if packed.nbytes < built.nbytes else {}  # else: the rows


def rebuilt_numbers(source: SpanKeys) -> torch.Tensor:
    """Sketch numbers (L, H, S, R) float32 of the decoded span keys, in levels, not yet rounded
    (no fixes)."""
    resident, rope = source.resident, source.rope
    code = load_code(resident, "k", source.code)
    scale = resident["sketch_scale"].float().cpu()  # (L, H, R)
    proj = resident["sketch_key"].float() / scale[:, :, None]  # (L, H, D, R), in levels
    offset = resident["sketch_mean"].float().cpu()[:, :, None] @ proj  # (L, H, 1, R)
    L, H, _, R = proj.shape
    rows_per_part = torch.diff(resident["part_rows"]).tolist()
    S = sum(rows_per_part)
    positions = span_token_positions(resident["span_starts"], resident["span_ends"]).repeat(H)
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
            # (k - mu) B / scale
            out[layer] = torch.baddbmm(offset[layer], keys.view(H, S, -1), proj[layer], beta=-1)
    return out


def key_parts(flat: torch.Tensor, part_rows: torch.Tensor) -> list[torch.Tensor]:
    """The parts' flat key records (views) of a store's one flat ``k_rows`` buffer: a part of
    n rows holds n rows' records of every layer and head."""
    per_row = flat.numel() // max(int(part_rows[-1]), 1)
    bounds = (part_rows * per_row).tolist()
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
